"""A fuzzer for every RPC of a gRPC service, driven by Hypothesis and the service's descriptors.

For each method of the service it sends request bytes from `proto_strategies.wire` (valid
messages over every field's whole range, and malformed ones) with a valid, a wrong or no bearer
token, each call under a deadline, and holds the answer to the front door's contract
(conductor/errors.py): no UNKNOWN or INTERNAL, no DEADLINE_EXCEEDED (a hang: nothing here sends
a deadline the server should hit), no UNAVAILABLE (the server died); a request that does not
decode is INVALID_ARGUMENT; a bad token is UNAUTHENTICATED; INVALID_ARGUMENT names its field
(google.rpc.BadRequest); a finished Generate stream ends with exactly one `final`.

    fuzzer = GrpcFuzzer(channel, pb.DESCRIPTOR.services_by_name["Generation"], token, hints)
    fuzzer.run(examples=30, seed=37)          # a seeded pass; or run_for(seconds, seed)
    fuzzer.stats                              # calls per (method, status)
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.fuzz.proto_strategies import Hints, wire

CALL_DEADLINE_S = 30.0
NEVER = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED,
                   grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DATA_LOSS})
# What the front door may answer a call it can read, with a good token (conductor/errors.py).
DOCUMENTED = frozenset({grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True, slots=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: tuple[Message, ...] = ()
    error: grpc.RpcError | None = None


class ContractViolation(AssertionError):
    """An answer outside the front door's contract, with the request that produced it."""


def call(channel: grpc.Channel, method: MethodDescriptor, body: bytes,
         metadata: tuple[tuple[str, str], ...]) -> Outcome:
    """Send `body` as-is (no serializer: malformed bytes reach the server) under a deadline."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    decode = GetMessageClass(method.output_type).FromString
    try:
        if method.server_streaming:
            stub = channel.unary_stream(path, request_serializer=None, response_deserializer=decode)
            return Outcome(grpc.StatusCode.OK, "", tuple(stub(body, timeout=CALL_DEADLINE_S, metadata=metadata)))
        unary = channel.unary_unary(path, request_serializer=None, response_deserializer=decode)
        return Outcome(grpc.StatusCode.OK, "", (unary(body, timeout=CALL_DEADLINE_S, metadata=metadata),))
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", error=e)


def decodes(method: MethodDescriptor, body: bytes) -> bool:
    try:
        GetMessageClass(method.input_type).FromString(body)
    except DecodeError:
        return False
    return True


def _field_violations(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    found = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [v.field for v in bad.field_violations]
    return found


def problems(method: MethodDescriptor, body: bytes, auth: str, outcome: Outcome) -> list[str]:
    """What is wrong with `outcome` as the answer to `body` sent with `auth` (valid|wrong|none)."""
    code, found = outcome.code, []
    if code in NEVER:
        found.append(f"status {code.name}: {outcome.details}")
    elif auth != "valid":
        if code is not grpc.StatusCode.UNAUTHENTICATED:
            found.append(f"a {auth} token was answered {code.name}, not UNAUTHENTICATED")
    elif code not in DOCUMENTED:
        found.append(f"status {code.name} is not one the front door documents: {outcome.details}")
    elif not decodes(method, body) and code is not grpc.StatusCode.INVALID_ARGUMENT:
        found.append(f"an undecodable request was answered {code.name}, not INVALID_ARGUMENT")
    if code is grpc.StatusCode.INVALID_ARGUMENT and outcome.error is not None and not _field_violations(outcome.error):
        found.append(f"INVALID_ARGUMENT without a BadRequest field violation: {outcome.details}")
    if code is grpc.StatusCode.OK and method.server_streaming:
        finals = [i for i, r in enumerate(outcome.responses) if r.HasField("final")]
        if finals != [len(outcome.responses) - 1]:
            found.append(f"a finished stream's `final` messages are at {finals} of {len(outcome.responses)}")
    return found


@dataclass
class GrpcFuzzer:
    channel: grpc.Channel
    service: ServiceDescriptor
    token: str
    hints: Hints = field(default_factory=dict)
    stats: Counter[tuple[str, str]] = field(default_factory=Counter)
    details: Counter[str] = field(default_factory=Counter)

    def _metadata(self, auth: str) -> tuple[tuple[str, str], ...]:
        return {"valid": (("authorization", f"Bearer {self.token}"),),
                "wrong": (("authorization", f"Bearer not-{self.token}"),), "none": ()}[auth]

    def check_one(self, method: MethodDescriptor, body: bytes, auth: str) -> None:
        outcome = call(self.channel, method, body, self._metadata(auth))
        self.stats[(method.name, outcome.code.name)] += 1
        self.details[f"{method.name} {outcome.code.name} {outcome.details[:60]}"] += 1
        found = problems(method, body, auth, outcome)
        if found:
            raise ContractViolation(f"{method.name} ({auth} token) request {body!r}: " + "; ".join(found))

    def fuzz_method(self, method: MethodDescriptor, examples: int, at_seed: int) -> None:
        """One Hypothesis run of `examples` calls of `method` (shrunk to the smallest failure)."""
        auth = st.sampled_from(["valid"] * 8 + ["wrong", "none"])

        @seed(at_seed)
        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(body=wire(method.input_type, self.hints), auth=auth)
        def one(body: bytes, auth: str) -> None:
            self.check_one(method, body, auth)

        one()

    def run(self, examples: int, at_seed: int) -> None:
        """`examples` calls of every RPC of the service."""
        for method in self.service.methods:
            self.fuzz_method(method, examples, at_seed)

    def run_for(self, seconds: float, at_seed: int, examples_per_round: int = 100) -> int:
        """Rounds of `run` (a new seed each) until `seconds` have passed; returns the rounds."""
        end, rounds = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            self.run(examples_per_round, at_seed + rounds)
            rounds += 1
        return rounds
