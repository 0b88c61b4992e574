"""The start-up profile under every engine shape `serve` can give a worker (issue 45): prompts
packed 1, 2, 4 or 8 a step (1 or 8 at TP=2), chunked prefill, speculation off or n-gram, tensor
parallelism 1 or 2, two model families (tiny random weights). Every grid point that fits is measured; none ends
early (what broke `make serve` on a fresh machine: one prompt a step made a batch of 4 take 4
prefill steps and the first request finished before the timed steps), and the cost model fits.
`prefill_steps`, the profiler's count of a batch's prefill steps, is checked against the
scheduler itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from halfmoon.conductor.cost_model import fit_profile
from halfmoon.core.params import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import Engine
from halfmoon.engine.profiling import ProfileGrid, measure_engine, prefill_steps
from tests.conftest import NUM_THREADS, assert_engine_idle
from tests.model_families import BY_NAME, build_checkpoint

pytestmark = [pytest.mark.timeout(600)]

FAMILIES = ("llama", "gemma3")
PACKING = (1, 2, 4, 8)
SPECULATION = ("off", "ngram")
# Prompts of 48 tokens over a 40-token step budget: every one is chunked.
GRID = ProfileGrid(prefill_new=(8, 32, 64), prefill_cached=(0, 32), decode_batches=(1, 4, 8),
                   decode_contexts=(16, 48), decode_steps=3)
BUDGET = 40


def _quiet_bar(**_: Any) -> Any:
    """No progress bar in the test's output (the bar's own behaviour is tqdm's)."""
    class Bar:
        def update(self, n: int = 1) -> None: ...
        def close(self) -> None: ...
    return Bar()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("profile-families")
    for name in FAMILIES:
        build_checkpoint(BY_NAME[name], root / name)
    return {name: root / name for name in FAMILIES}


def _engine(folder: Path, packing: int, speculative: str, tp: int) -> Engine:
    return Engine(EngineConfig(model=str(folder), num_blocks=160, num_threads=NUM_THREADS, tp=tp,
                               max_num_batched_tokens=BUDGET, max_prefill_seqs=packing,
                               speculative=speculative, speculative_max_batch=16))


def _engines(folders: dict[str, Path], tp: int) -> Iterator[tuple[str, Engine]]:
    # a TP=2 engine starts a process group (about 3 s): the packings at both ends of the range
    packings = PACKING if tp == 1 else (PACKING[0], PACKING[-1])
    for name, packing, speculative in itertools.product(FAMILIES, packings, SPECULATION):
        engine = _engine(folders[name], packing, speculative, tp)
        try:
            yield f"{name} packing={packing} speculative={speculative} tp={tp}", engine
        finally:
            engine.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_every_engine_shape_profiles_every_point(folders: dict[str, Path], tp: int) -> None:
    failures = []
    for shape, engine in _engines(folders, tp):
        profile = measure_engine(engine, quick=True, grid=GRID, bar=_quiet_bar)
        if profile.skipped or len(profile.decode) != 6 or len(profile.prefill) != 6:
            failures.append(f"{shape}: {len(profile.prefill)} prefill, {len(profile.decode)} decode "
                            f"points; skipped {profile.skipped}")
        fit_profile(profile)  # enough points to fit both polynomials
        assert_engine_idle(engine)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("batch", "context", "packing"), [
    (4, 128, 1), (8, 16, 2), (8, 48, None), (4, 100, 4), (3, 90, 2), (8, 48, 1), (1, 128, 1), (16, 20, 8)])
def test_prefill_steps_is_what_the_scheduler_takes(make_engine: Any, batch: int, context: int,
                                                  packing: int | None) -> None:
    """The steps until every prompt of a batch queued at once has computed (SmolLM2, 40-token
    budget: chunked), counted on the real scheduler."""
    engine = make_engine(num_blocks=160, max_num_batched_tokens=BUDGET, max_prefill_seqs=packing)
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        ids = [engine.add_request(list(range(16 + 1000 * j, 16 + 1000 * j + context)), params) for j in range(batch)]
        started: set[str] = set()
        steps = 0
        while len(started) < batch:
            steps += 1
            started.update(out.request_id for out in engine.step())
        assert prefill_steps(batch, context, engine.config) == steps
    finally:
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
