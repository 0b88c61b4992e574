"""A real evaluation harness against Halfmoon (issue 46): lm-evaluation-harness's
`local-completions` backend scores a small local multiple-choice task (loglikelihood of each
choice) through Halfmoon's /v1/completions (`echo` + `logprobs`, `max_tokens` 1), and its own
`hf` backend scores it on transformers' model built from the same GGUF. Same accuracy, and every
choice's loglikelihood within 2e-3 (both fp32; what is left is the two implementations' rounding).

Both sides get the very same token ids: lm_eval tokenizes context and continuation itself (one
tokenizer folder, saved from transformers' GGUF tokenizer) and `local-completions` sends ids."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from halfmoon.api.server import ServerConfig
from halfmoon.conductor.colocated import ColocatedBackend
from tests.conductor.conftest import CLIENT_SLOS_ONLY, MODEL, RunningApi, run_api
from tests.conftest import EngineFactory

pytestmark = [pytest.mark.slow]

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TASK = "halfmoon_mc"
TOLERANCE = 2e-3  # per choice, nats


@pytest.fixture(scope="module")
def lm_eval() -> Iterator[Any]:
    """lm_eval, offline for the module's tests (datasets reads these when first imported, in
    `simple_evaluate`). A [test] dependency: missing, the suite fails rather than skips."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        try:
            import lm_eval
        except ImportError as e:
            pytest.fail(f"lm_eval is not installed ({e}): run make setup (the [test] extra has lm_eval)")
        yield lm_eval


@pytest.fixture(scope="module")
def served(make_engine: EngineFactory) -> Iterator[RunningApi]:
    """Halfmoon's front door on loopback over a fp32 engine (the engine's token-exact mode)."""
    backend = ColocatedBackend(make_engine(num_blocks=128), MODEL, max_waiting=64, admission=CLIENT_SLOS_ONLY)
    api = run_api(backend, ServerConfig(grpc_port=0, http_port=0))
    yield api
    api.stop()


@pytest.fixture(scope="module")
def tokenizer_dir(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' tokenizer of the GGUF as a folder: both backends load it by path."""
    from halfmoon.bench.hf_reference import hf_tokenizer

    folder = tmp_path_factory.mktemp("lm-eval-tokenizer")
    hf_tokenizer(gguf_path).save_pretrained(str(folder))
    return folder


def task_config(cache: Path) -> dict[str, Any]:
    """The committed task, its data file made absolute (datasets resolves it against the cwd)."""
    config = yaml.safe_load((TASK_DIR / f"{TASK}.yaml").read_text())
    files = config["dataset_kwargs"]["data_files"]
    config["dataset_kwargs"] = {"data_files": {k: str(TASK_DIR / v) for k, v in files.items()},
                                "cache_dir": str(cache)}
    return config


def evaluate(lm_eval: Any, model: str, model_args: str | dict[str, Any], cache: Path) -> dict[str, Any]:
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task_config(cache)], batch_size=1,
                                  log_samples=True, bootstrap_iters=0, random_seed=0)
    assert out is not None
    return out


def per_choice(out: dict[str, Any]) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> each choice's (loglikelihood, greedy), in the choices' order."""
    return {s["doc_id"]: [(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]]
            for s in out["samples"][TASK]}


def test_local_completions_equals_hf_backend(lm_eval: Any, served: RunningApi, tokenizer_dir: Path,
                                            gguf_path: Path, tmp_path: Path) -> None:
    from halfmoon.bench.hf_reference import hf_model

    api_args = (f"model={MODEL},base_url={served.http_url}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tokenizer_dir},tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=120")
    served_out = evaluate(lm_eval, "local-completions", api_args, tmp_path / "datasets")
    model = hf_model(gguf_path, torch.float32)
    hf_out = evaluate(lm_eval, "hf", {"pretrained": model, "tokenizer": str(tokenizer_dir), "dtype": "float32",
                                      "device": "cpu"}, tmp_path / "datasets")

    got, want = per_choice(served_out), per_choice(hf_out)
    lines = (TASK_DIR / "questions.jsonl").read_text(encoding="utf-8").splitlines()
    assert sorted(got) == sorted(want) == list(range(len(lines)))
    worst = 0.0
    for doc_id, choices in want.items():
        assert len(got[doc_id]) == len(choices) == 4, doc_id
        for (ll, greedy), (ref_ll, ref_greedy) in zip(got[doc_id], choices):
            assert math.isfinite(ll) and ll < 0, (doc_id, ll)
            assert abs(ll - ref_ll) <= TOLERANCE, f"doc {doc_id}: halfmoon {ll} vs hf {ref_ll}"
            assert greedy == ref_greedy, f"doc {doc_id}: greedy {greedy} vs hf {ref_greedy} ({ll})"
            worst = max(worst, abs(ll - ref_ll))
    accuracy = {out_name: {m: out["results"][TASK][f"{m},none"] for m in ("acc", "acc_norm")}
                for out_name, out in (("halfmoon", served_out), ("hf", hf_out))}
    assert accuracy["halfmoon"] == accuracy["hf"], accuracy
    print(f"lm_eval {TASK}: {accuracy['halfmoon']} on {len(lines)} questions; max |dll| {worst:.2e}")
    assert served.wait_idle() == []
