"""`halfmoon generate`: one prompt through the co-located engine, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from halfmoon.core.errors import InvalidRequestError
from halfmoon.core.params import Constraint


def add_parser(p: argparse.ArgumentParser) -> None:
    from halfmoon.cli.client import add_sampling_extras
    from halfmoon.cli.components import ENGINE
    from halfmoon.cli.flags import add_flags

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_sampling_extras(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_flags(p, ENGINE)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise InvalidRequestError("prompt_ids", f"expected comma-separated integers, got {text!r}") from e


def prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        if args.chat:
            raise InvalidRequestError("chat", "--chat needs --prompt text, not --prompt-ids")
        return parse_ids(args.prompt_ids)
    text = args.prompt
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(text)


def constraint_of(args: argparse.Namespace) -> Constraint | None:
    """The output constraint the flags name (the SDK's keywords, as the gRPC API takes them)."""
    from halfmoon.api.structured import from_proto
    from halfmoon.cli.client import constraint_options
    from halfmoon.messages import generate_request

    return from_proto(generate_request("", **constraint_options(args)).constraint)


def run(args: argparse.Namespace) -> int:
    from halfmoon.engine.engine import Engine
    from halfmoon.core.params import SamplingParams
    from halfmoon.cli.components import ENGINE
    from halfmoon.cli.flags import build

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos,
                            stop=tuple(args.stop), frequency_penalty=args.frequency_penalty or 0.0,
                            presence_penalty=args.presence_penalty or 0.0,
                            repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty,
                            logit_bias=tuple(args.logit_bias), min_tokens=args.min_tokens or 0,
                            logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                            n=1 if args.n is None else args.n, constraint=constraint_of(args))
    # Bad flags fail before the model loads (seconds): every rule but the vocabulary's, which
    # needs the model and is checked by the engine.
    params.validate(vocab_size=sys.maxsize)
    if args.prompt_ids is not None:
        prompt_ids(args, None)
    engine = Engine(build(ENGINE, args))
    try:
        return _generate(args, engine, params)
    finally:
        engine.close()


def _generate(args: argparse.Namespace, engine, params) -> int:
    ids = prompt_ids(args, engine.tokenizer)
    from halfmoon.engine.outputs import completion_result

    engine.add_request(ids, params, request_id="cli")
    chunks = []
    while not chunks or not chunks[-1].finished:
        for chunk in engine.step():
            chunks.append(chunk)
            if not args.json and chunk.text and chunk.index == 0:  # the other choices at the end
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    choices = [completion_result("cli", ids, chunks, i) for i in range(params.n)]
    result = choices[0]
    if args.json:
        print(json.dumps({"prompt_ids": ids, **_choice_json(result), "ttft_ms": round(result.ttft_ms, 3),
                          "tpot_ms": round(result.tpot_ms, 3),
                          "prompt_logprobs": _logprobs_json(result.prompt_logprobs),
                          **({"choices": [_choice_json(c) for c in choices]} if params.n > 1 else {})}))
    else:
        sys.stdout.write("\n")
        for i, choice in enumerate(choices[1:], start=1):
            print(f"--- choice {i} ({choice.finish_reason.value}) ---\n{choice.text}")
        print(f"[{result.finish_reason.value}: {len(result.output_ids)} tokens, "
              f"TTFT {result.ttft_ms:.0f} ms, TPOT {result.tpot_ms:.1f} ms]", file=sys.stderr)
    return 0


def _choice_json(result) -> dict:
    return {"output_ids": result.output_ids, "text": result.text, "finish_reason": result.finish_reason.value,
            "logprobs": _logprobs_json(result.logprobs)}


def _logprobs_json(logprobs) -> list | None:
    if logprobs is None:
        return None
    return [{"logprob": lp.logprob, "top": [list(pair) for pair in lp.top]} for lp in logprobs]
