"""`halfmoon client`: call a running server over gRPC (generate, chat, models, tokenize).

    halfmoon client generate --target localhost:50051 'The capital of France is'
    halfmoon client chat --target HOST:PORT --tls --ca-cert ca.pem --token-file TOKENS 'Hi!'

Text streams to stdout as it arrives and a summary goes to stderr (`--json`: one JSON object).
An API error prints `halfmoon: error: STATUS: message` and exits 2 (3 when UNAVAILABLE: the
server could not be reached or cannot serve now, so retrying later may help).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError

if TYPE_CHECKING:  # grpc is imported only when a call is made
    from halfmoon.client import APIError, Client

EXIT_ERROR = 2
EXIT_UNAVAILABLE = 3


def add_parser(p: argparse.ArgumentParser) -> None:
    p.description, p.formatter_class = __doc__, argparse.RawDescriptionHelpFormatter
    calls = p.add_subparsers(dest="call", required=True)
    conn = _connection_parser()
    gen = _generation_parser()
    g = calls.add_parser("generate", parents=[conn, gen], help="complete a prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("prompt", nargs="?", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids instead of text, e.g. 1,2,3")
    c = calls.add_parser("chat", parents=[conn, gen], help="one user message, with the chat template")
    c.add_argument("message", help="the user's message")
    c.add_argument("--system", default=None, help="a system message before it")
    m = calls.add_parser("models", parents=[conn], help="list the served models")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t = calls.add_parser("tokenize", parents=[conn], help="print the token ids of a text")
    t.add_argument("text")
    t.add_argument("--json", action="store_true", help="print a JSON list instead of 1,2,3")


def _connection_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    net = p.add_argument_group("connection")
    net.add_argument("--target", default="localhost:50051", help="server address HOST:PORT")
    net.add_argument("--tls", action="store_true", help="connect with TLS (system CAs unless --ca-cert)")
    net.add_argument("--ca-cert", default=None, help="PEM CA certificate to verify the server (implies --tls)")
    net.add_argument("--token-file", default=None,
                     help="file holding the bearer token (default: $HALFMOON_API_TOKEN, else none)")
    net.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    return p


def _generation_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    s = p.add_argument_group("generation (unset = the server's default)")
    s.add_argument("--model", default="", help="model id (default: the served model)")
    s.add_argument("--max-tokens", type=_natural, default=None, help="server default: 16")
    s.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=_natural, default=None, help="0 = off")
    s.add_argument("--seed", type=_natural, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--ttft-slo-ms", type=float, default=None, help="reject up front if TTFT would miss this")
    s.add_argument("--tbt-slo-ms", type=float, default=None, help="reject up front if TBT would miss this")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def _natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from halfmoon.client import APIError, Client, UnavailableError

    try:
        with Client(args.target, token_file=args.token_file, tls=args.tls,
                    root_certificates=_read_ca(args.ca_cert), timeout=args.timeout) as client:
            if args.call == "models":
                return _models(args, client)
            if args.call == "tokenize":
                return _tokenize(args, client)
            return _generate(args, client)
    except APIError as e:
        print(f"halfmoon: error: {describe(e)}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, UnavailableError) else EXIT_ERROR


def describe(e: APIError) -> str:
    """One line for a user: status, message, and the details a user can act on."""
    extra = []
    if e.field and not e.message.startswith(f"{e.field}:"):
        extra.append(f"field: {e.field}")
    if e.retry_after_s is not None:
        extra.append(f"retry after {e.retry_after_s:g} s")
    if e.prediction:
        extra.append(", ".join(f"{k}={v:g}" for k, v in e.prediction.items()))
    return f"{e.code.name}: {e.message}" + "".join(f" ({x})" for x in extra)


def _read_ca(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the CA certificate {path}: {e}") from e


def _request_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
               "top_k": args.top_k, "seed": args.seed, "stop": args.stop, "ignore_eos": args.ignore_eos,
               "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms, "model": args.model}
    if args.call == "chat":
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return {**options, "messages": [*system, {"role": "user", "content": args.message}]}
    if args.prompt_ids is not None:
        from cli.generate import parse_ids

        return {**options, "prompt_token_ids": parse_ids(args.prompt_ids)}
    return {**options, "prompt": args.prompt}


def _generate(args: argparse.Namespace, client: Client) -> int:
    options = _request_options(args)
    if args.json:
        print(json.dumps(dataclasses.asdict(client.generate(**options))))
        return 0
    result = None
    for chunk in client.stream(**options):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    t = result.timings
    print(f"[{result.finish_reason}: {result.usage.completion_tokens} tokens, TTFT {t.ttft_ms:.0f} ms, "
          f"TPOT {t.mean_tpot_ms:.1f} ms]", file=sys.stderr)
    return 0


def _models(args: argparse.Namespace, client: Client) -> int:
    models = client.models()
    if args.json:
        print(json.dumps([dataclasses.asdict(m) for m in models]))
        return 0
    rows = [("ID", "MAX_MODEL_LEN", "VOCAB_SIZE", "OWNED_BY")]
    rows += [(m.id, str(m.max_model_len), str(m.vocab_size), m.owned_by) for m in models]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _tokenize(args: argparse.Namespace, client: Client) -> int:
    ids = client.tokenize(args.text)
    print(json.dumps(ids) if args.json else ",".join(map(str, ids)))
    return 0
