"""`halfmoon client`: call a running server over gRPC (generate, chat, models, tokenize, adapters).

    halfmoon client generate --target localhost:50051 'The capital of France is'
    halfmoon client chat --target HOST:PORT --tls --ca-cert ca.pem --token-file TOKENS 'Hi!'
    halfmoon client adapters load sql-lora /adapters/sql --admin-token-file ADMIN_TOKENS
    halfmoon client adapters list | unload sql-lora

Text streams to stdout as it arrives and a summary goes to stderr (`--json`: one JSON object).
An API error prints `halfmoon: error: STATUS: message` and exits 2 (3 when UNAVAILABLE: the
server could not be reached or cannot serve now, so retrying later may help). A request the
server rejected up front (admission: a predicted SLO miss, a full queue; nothing was spent on it)
prints one line and exits 4, e.g.

    halfmoon: rejected (429 / RESOURCE_EXHAUSTED, reason ttft): predicted TTFT 3100 ms > SLO 2000 ms; retry after 2 s

`--retry-rejected N` waits the server's hint and sends it again, up to N times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from halfmoon.core.errors import ConfigError

if TYPE_CHECKING:  # grpc is imported only when a call is made
    from halfmoon.client import APIError, Client, RetryEvent

EXIT_ERROR = 2
EXIT_UNAVAILABLE = 3
EXIT_REJECTED = 4


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
    tools = c.add_argument_group("tools")
    tools.add_argument("--tools", default=None, metavar="TOOLS",
                       help="functions the model may call: a JSON list of OpenAI tools or of {name, description, "
                            "parameters} (its text, or @FILE); the calls print after the text")
    tools.add_argument("--tool-choice", default=None, metavar="CHOICE",
                       help="none, auto (the default with tools), required, or a function's name")
    tools.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call")
    m = calls.add_parser("models", parents=[conn], help="list the served models")
    m.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t = calls.add_parser("tokenize", parents=[conn], help="print the token ids of a text")
    t.add_argument("text")
    t.add_argument("--json", action="store_true", help="print a JSON list instead of 1,2,3")
    _add_adapters_parser(calls, conn)


def _add_adapters_parser(calls: argparse._SubParsersAction, conn: argparse.ArgumentParser) -> None:
    """`adapters list|load NAME PATH|unload NAME`: the admin API (an admin token)."""
    admin = argparse.ArgumentParser(add_help=False)
    admin.add_argument("--admin-token-file", default=None,
                       help="file holding the admin token (default: $HALFMOON_ADMIN_TOKEN, else the API token)")
    admin.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = calls.add_parser("adapters", help="LoRA adapters: list, load, unload (admin)")
    verbs = a.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", parents=[conn, admin], help="the loaded adapters")
    load = verbs.add_parser("load", parents=[conn, admin], help="serve the PEFT adapter in PATH as model NAME")
    load.add_argument("name", metavar="NAME", help="the model name requests will use")
    load.add_argument("path", metavar="PATH", help="the adapter's folder, as the server sees it")
    unload = verbs.add_parser("unload", parents=[conn, admin], help="stop serving adapter NAME")
    unload.add_argument("name", metavar="NAME")


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
    add_sampling_extras(s)
    s.add_argument("--ttft-slo-ms", type=float, default=None, help="reject up front if TTFT would miss this")
    s.add_argument("--tbt-slo-ms", type=float, default=None, help="reject up front if TBT would miss this")
    s.add_argument("--priority-class", default=None,
                   help="interactive, standard or batch: the request's SLOs (unless set above) and queue "
                        "rank (default: the server's default class)")
    s.add_argument("--retry-rejected", type=_natural, default=0, metavar="N",
                   help="when the server rejects the request up front, wait its Retry-After and send it "
                        "again, up to N times (default 0)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def add_sampling_extras(s: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """The penalties, biases, logprobs and n flags (`halfmoon client` and `halfmoon generate`)."""
    s.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI's, [-2, 2]")
    s.add_argument("--presence-penalty", type=float, default=None, help="OpenAI's, [-2, 2]")
    s.add_argument("--repetition-penalty", type=float, default=None, help="HF's, > 0; 1 = off")
    s.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS", type=_bias,
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")
    s.add_argument("--min-tokens", type=_natural, default=None, help="EOS and stop ids held back this long")
    s.add_argument("--logprobs", type=_natural, default=None, metavar="N",
                   help="each token's logprob and the N most likely (--json shows them)")
    s.add_argument("--prompt-logprobs", type=_natural, default=None, metavar="N",
                   help="the same for the prompt's tokens (--json shows them)")
    s.add_argument("--n", type=_natural, default=None, metavar="N",
                   help="N choices from one prefill (choice i seeded --seed + i)")
    c = s.add_mutually_exclusive_group()
    c.add_argument("--json-schema", default=None, metavar="SCHEMA",
                   help="the output is JSON valid against this schema (its JSON text, or @FILE)")
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", default=None, help="the whole output matches this regex (Rust syntax)")
    c.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is exactly one of these (repeatable)")
    c.add_argument("--grammar", default=None, metavar="GRAMMAR",
                   help="the output follows this Lark or GBNF grammar (its text, or @FILE)")


def constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SDK's constraint keywords from the flags (`@FILE` reads a schema or grammar)."""
    return {"json_schema": _text_or_file(args.json_schema), "json_object": args.json_object,
            "regex": args.regex, "choice": args.choice, "grammar": _text_or_file(args.grammar)}


def tool_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SDK's tool keywords from `chat`'s flags."""
    text = _text_or_file(args.tools)
    tools = None
    if text is not None:
        try:
            tools = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--tools: not valid JSON: {e}") from e
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ConfigError("--tools: a JSON list of tools (objects)")
    return {"tools": tools, "tool_choice": args.tool_choice,
            "parallel_tool_calls": False if args.no_parallel_tool_calls else None}


def _text_or_file(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read {value[1:]}: {e}") from e


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
                    root_certificates=_read_ca(args.ca_cert), timeout=args.timeout,
                    retry_rejected=getattr(args, "retry_rejected", 0), on_retry=_announce_retry,
                    admin_token_file=getattr(args, "admin_token_file", None)) as client:
            if args.call == "models":
                return _models(args, client)
            if args.call == "adapters":
                return _adapters(args, client)
            if args.call == "tokenize":
                return _tokenize(args, client)
            return _generate(args, client)
    except APIError as e:
        if e.rejected:
            print(f"halfmoon: {describe_rejection(e)}", file=sys.stderr)
            return EXIT_REJECTED
        print(f"halfmoon: error: {describe(e)}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, UnavailableError) else EXIT_ERROR


def _announce_retry(event: RetryEvent) -> None:
    if event.error.rejected:
        print(f"halfmoon: {describe_rejection(event.error)}; retrying in {event.delay_s:.1f} s", file=sys.stderr)


def describe(e: APIError) -> str:
    """One line for a user: status, message, and the details a user can act on."""
    extra = []
    if e.field and not e.message.startswith(f"{e.field}:"):
        extra.append(f"field: {e.field}")
    if e.retry_after_s is not None:
        extra.append(f"retry after {e.retry_after_s:g} s")
    if e.prediction is not None:
        extra.append(", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(e.prediction).items()))
    return f"{e.code.name}: {e.message}" + "".join(f" ({x})" for x in extra)


def describe_rejection(e: APIError) -> str:
    """One line for a rejected request: why (the prediction against its objective where that was
    the reason, else the server's message) and when to try again."""
    p, what = e.prediction, e.message
    if p is not None and e.reason == "ttft" and p.ttft_slo_ms and p.predicted_ttft_ms > p.ttft_slo_ms:
        what = f"predicted TTFT {p.predicted_ttft_ms:.0f} ms > SLO {p.ttft_slo_ms:.0f} ms"
    elif p is not None and e.reason == "tbt" and p.tbt_slo_ms and p.predicted_tbt_ms > p.tbt_slo_ms:
        what = f"predicted TBT {p.predicted_tbt_ms:.1f} ms > SLO {p.tbt_slo_ms:.1f} ms"
    return (f"rejected (429 / {e.code.name}, reason {e.reason or 'unknown'}): {what}; "
            f"retry after {e.retry_after_s:g} s")


def _bias(text: str) -> tuple[int, float]:
    """`ID=BIAS` -> (token id, bias)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 28=-100), got {text!r}") from None


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
               "ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms,
               "priority_class": args.priority_class, "model": args.model,
               "frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty,
               "repetition_penalty": args.repetition_penalty, "logit_bias": dict(args.logit_bias) or None,
               "min_tokens": args.min_tokens, "logprobs": args.logprobs, "prompt_logprobs": args.prompt_logprobs,
               "n": args.n, **constraint_options(args)}
    if args.call == "chat":
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return {**options, **tool_options(args), "messages": [*system, {"role": "user", "content": args.message}]}
    if args.prompt_ids is not None:
        from halfmoon.cli.generate import parse_ids

        return {**options, "prompt_token_ids": parse_ids(args.prompt_ids)}
    return {**options, "prompt": args.prompt}


def _generate(args: argparse.Namespace, client: Client) -> int:
    options = _request_options(args)
    if args.json:
        print(json.dumps(dataclasses.asdict(client.generate(**options))))
        return 0
    result = None
    for chunk in client.stream(**options):
        if chunk.text and chunk.index == 0:  # n > 1: the other choices are printed at the end
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        result = chunk.result or result
    sys.stdout.write("\n")
    for call in result.tool_calls:
        print(f"--- tool call {call.id}: {call.name}({call.arguments})")
    for i, choice in enumerate(result.choices[1:], start=1):
        print(f"--- choice {i} ({choice.finish_reason}) ---\n{choice.text}")
        for call in choice.tool_calls:
            print(f"--- tool call {call.id}: {call.name}({call.arguments})")
    t, p = result.timings, result.prediction
    predicted = f" (predicted {p.predicted_ttft_ms:.0f} ms)" if p is not None else ""
    print(f"[{result.finish_reason}: {result.usage.completion_tokens} tokens, TTFT {t.ttft_ms:.0f} ms{predicted}, "
          f"TPOT {t.mean_tpot_ms:.1f} ms]", file=sys.stderr)
    return 0


def _models(args: argparse.Namespace, client: Client) -> int:
    models = client.models()
    if args.json:
        print(json.dumps([dataclasses.asdict(m) for m in models]))
        return 0
    rows = [("ID", "MAX_MODEL_LEN", "VOCAB_SIZE", "OWNED_BY", "PARENT")]
    rows += [(m.id, str(m.max_model_len), str(m.vocab_size), m.owned_by, m.parent or "-") for m in models]
    _table(rows)
    return 0


def _adapters(args: argparse.Namespace, client: Client) -> int:
    if args.verb == "load":
        adapters = [client.load_adapter(args.name, args.path)]
    elif args.verb == "unload":
        adapters = [client.unload_adapter(args.name)]
    else:
        adapters = client.adapters()
    if args.json:
        print(json.dumps([dataclasses.asdict(a) for a in adapters]))
        return 0
    if args.verb != "list":
        a = adapters[0]
        print(f"{args.verb}ed {a.name} (rank {a.rank}, {', '.join(a.target_modules)}) from {a.path}")
        return 0
    _table([("NAME", "RANK", "TARGETS", "PATH")] +
           [(a.name, str(a.rank), ",".join(a.target_modules), a.path) for a in adapters])
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _tokenize(args: argparse.Namespace, client: Client) -> int:
    ids = client.tokenize(args.text)
    print(json.dumps(ids) if args.json else ",".join(map(str, ids)))
    return 0
