"""Measuring a real engine for the cost model: prefill times over a grid of (new, cached) prompt
tokens, decode step times over (batch, context tokens), and the KV bytes per token.

A worker measures itself (`EngineWorker.profile`) and the Conductor fits the result
(conductor.cost_model.fit_profile); `halfmoon profile` does both in one process. The measuring
lives with the engine because it drives one: the engine never imports the Conductor.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from halfmoon.core.errors import ConfigError, HalfmoonError
from halfmoon.core.messages import DecodeSample, PrefillSample, Profile
from halfmoon.core.params import SamplingParams

if TYPE_CHECKING:
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.engine import Engine

log = logging.getLogger(__name__)
# tqdm's constructor: `bar(total=, desc=, unit=)` -> a bar with `.update(n)` and `.close()`.
ProgressBar = Callable[..., Any]

# Profile requests hash under their own salt: they never match (or pollute) a tenant's prefixes.
PROFILE_SALT = "halfmoon-profile"


class ProfileError(HalfmoonError):
    """The engine cannot be profiled (busy, or too small for any grid point)."""


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    """Where `measure_engine` samples. Points that do not fit the engine (KV pool, context
    limit, max_num_seqs) are skipped.

    prefill_new / prefill_cached: new x cached prompt tokens (cached: multiples of block_size).
    decode_batches / decode_contexts: running requests x prompt tokens of each.
    decode_steps: timed decode steps per point (their lower quartile is the sample), after one
        untimed.
    prefill_repeats: prefills per point, each on fresh tokens (the fastest is the sample).

    Other processes only ever add time, so low statistics estimate the engine's own cost.
    """

    prefill_new: tuple[int, ...]
    prefill_cached: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_steps: int
    prefill_repeats: int = 1

    def __post_init__(self) -> None:
        sizes = (*self.prefill_new, *self.decode_batches, *self.decode_contexts, self.decode_steps,
                 self.prefill_repeats)
        if min(sizes, default=0) < 1 or min(self.prefill_cached, default=-1) < 0:
            raise ConfigError(f"profile grid needs sizes >= 1 and cached lengths >= 0: {self}")

    @property
    def num_points(self) -> int:
        return (len(self.prefill_new) * len(self.prefill_cached)
                + len(self.decode_batches) * len(self.decode_contexts))


# SmolLM2 fp32 on one thread: quick ~12 s (the decode points' prefills are most of it), full
# ~2-3 min.
QUICK_GRID = ProfileGrid((16, 64, 256, 512), (0, 256), (1, 4, 8), (16, 128), 6)
FULL_GRID = ProfileGrid((16, 32, 64, 128, 256, 512, 1024), (0, 256, 1024), (1, 2, 4, 8, 16),
                        (32, 128, 512), 8, prefill_repeats=2)


def measure_engine(engine: Engine, *, quick: bool, grid: ProfileGrid | None = None,
                   bar: ProgressBar = tqdm) -> Profile:
    """Time prefills and decode steps of a real engine on deterministic token ids. The engine
    must be idle; it is idle again afterwards (the profile's blocks stay as salted prefix cache).
    A point that cannot be measured is skipped with a warning and named in `Profile.skipped`.
    `bar`: the progress bar's class (tqdm's signature; a Ray actor passes Ray's, which the
    driver draws)."""
    if engine.has_unfinished():
        raise ProfileError("the engine is busy; profile it before it serves requests")
    grid = grid or (QUICK_GRID if quick else FULL_GRID)
    skipped: list[str] = []
    _warm_up(engine)
    kind = "quick" if quick else "full"
    with contextlib.closing(bar(total=grid.num_points, desc=f"{kind} profile", unit="pt")) as progress:
        prefill = _measure_prefills(engine, grid, progress.update)
        decode = _measure_decodes(engine, grid, progress.update, skipped)
    cfg = engine.config
    source = (f"{cfg.model} {cfg.kv_tag} threads={cfg.num_threads or 'default'} "
              f"{kind} profile, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    if skipped:
        log.warning("profile: %d of %d decode points not measured (the cost model is fitted to the "
                    "rest): %s", len(skipped), len(grid.decode_batches) * len(grid.decode_contexts),
                    "; ".join(skipped))
    return Profile(tuple(prefill), tuple(decode), kv_bytes_per_token(engine), source, tuple(skipped))


def kv_bytes_per_token(engine: Engine) -> int:
    """KV bytes of one token: layers x (K, V) x kv_heads x head_dim x itemsize, every
    tensor-parallel rank's shard (`Engine.kv_bytes_per_token`)."""
    return engine.kv_bytes_per_token


def _tokens(engine: Engine, seed: int, n: int) -> list[int]:
    """Deterministic token ids, distinct per seed (so no sample hits another's cache)."""
    vocab = engine.model_config.vocab_size
    return np.random.default_rng(seed).integers(16, vocab, size=n).tolist()


def _max_prompt_tokens(engine: Engine) -> int:
    """Longest prompt that leaves room for one output token in the context and the KV pool."""
    return min(engine.max_model_len, engine.pool.num_blocks * engine.config.block_size) - 1


def _prefill_once(engine: Engine, prompt: list[int]) -> PrefillSample:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    result = engine.generate([prompt], params, cache_salt=PROFILE_SALT)[0]
    return PrefillSample(len(prompt) - result.num_cached_tokens, result.num_cached_tokens,
                         result.prefill_ms)


def _warm_up(engine: Engine) -> None:
    """First passes pay one-time costs (allocations, weight packing) that are no one's prefill."""
    for seed in (1, 2):
        _prefill_once(engine, _tokens(engine, seed, 64))


def _measure_prefills(engine: Engine, grid: ProfileGrid, tick: Callable[[int], Any]) -> list[PrefillSample]:
    """For each cached length c: compute a c-token prefix once, then prefill prefix + n fresh
    tokens for each n (the engine reports how much it actually served from its cache)."""
    samples, seed = [], 1000
    limit = _max_prompt_tokens(engine)
    for cached in grid.prefill_cached:
        fitting = [n for n in grid.prefill_new if cached + n <= limit]
        tick(len(grid.prefill_new) - len(fitting))
        if not fitting:
            continue
        prefix = _tokens(engine, seed, cached)
        seed += 1
        if cached:
            _prefill_once(engine, prefix)
        for n_new in fitting:
            runs = [_prefill_once(engine, prefix + _tokens(engine, seed + r, n_new))
                    for r in range(grid.prefill_repeats)]
            seed += grid.prefill_repeats
            samples.append(min(runs, key=lambda s: s.ms))
            tick(1)
    return samples


def _measure_decodes(engine: Engine, grid: ProfileGrid, tick: Callable[[int], Any],
                     skipped: list[str]) -> list[DecodeSample]:
    samples = []
    for i, (batch, context) in enumerate(itertools.product(grid.decode_batches, grid.decode_contexts)):
        tick(1)
        point = f"decode batch={batch} context={context}"
        try:
            sample = _decode_point(engine, batch, context, grid.decode_steps, seed=2000 + 100 * i)
        except ProfileError as e:  # one point that cannot be measured never ends the profile
            log.warning("profile: %s skipped: %s", point, e)
            skipped.append(f"{point}: {e}")
            continue
        if sample is None:
            skipped.append(f"{point}: does not fit this engine")
        else:
            samples.append(sample)
    return samples


def prefill_steps(batch: int, context: int, config: EngineConfig) -> int:
    """Steps until `batch` `context`-token prompts, queued at once, have all computed their
    prompt, as the engine's scheduler packs them (engine/scheduler.py): running requests first,
    in admission order (a decoding one takes 1 token of the step's budget, a prefilling one its
    next chunk), then waiting prompts while the budget lasts, at most `max_prefill_seqs` prompts
    computing a step and `max_num_seqs` running. Speculative drafts may take more of a step's
    budget; `_decode_point` gives its requests room for that."""
    budget, cap = config.max_num_batched_tokens, config.max_prefill_seqs or batch
    if batch >= budget:
        raise ValueError(f"{batch} decoding requests would take the whole {budget}-token budget")
    left: list[int] = []  # prompt tokens still to compute of each admitted request, in order
    waiting, steps = batch, 0
    while waiting or any(left):
        steps += 1
        room, prefills = budget, 0
        for i, rest in enumerate(left):
            if room <= 0:
                break
            n = min(rest or 1, room)
            if rest:
                left[i] -= n
                prefills += 1
            room -= n
        while waiting and room > 0 and prefills < cap and len(left) < config.max_num_seqs:
            n = min(context, room)
            left.append(context - n)
            waiting, room, prefills = waiting - 1, room - n, prefills + 1
    return steps


def _decode_point(engine: Engine, batch: int, context: int, steps: int, seed: int) -> DecodeSample | None:
    """Time of one decode-only step of `batch` requests with `context`-token prompts
    (None when they do not fit). The requests need tokens enough to keep decoding through
    every prefill step the engine takes for the batch (`prefill_steps`), the untimed step and
    the timed ones, at the most tokens a step gives one (speculation); each is allowed all
    that its share of the KV pool and the context hold (the point is aborted once timed)."""
    cfg = engine.config
    if batch > cfg.max_num_seqs or cfg.max_num_batched_tokens <= batch:
        return None
    per_step = 1 + (cfg.speculative_tokens if cfg.speculative != "off" else 0)
    needed = (prefill_steps(batch, context, cfg) + steps + 2) * per_step
    room = min(engine.max_model_len, engine.pool.num_blocks // batch * cfg.block_size) - context
    if room < needed:
        return None
    params = SamplingParams(max_tokens=room, ignore_eos=True)
    ids = [engine.add_request(_tokens(engine, seed + j, context), params, cache_salt=PROFILE_SALT)
           for j in range(batch)]
    try:
        return _time_decode_steps(engine, ids, context, steps)
    finally:
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()


def _time_decode_steps(engine: Engine, ids: list[str], context: int, steps: int) -> DecodeSample:
    lengths = dict.fromkeys(ids, context)  # context tokens of each request (prompt + outputs)
    started: set[str] = set()
    times: list[float] = []
    totals: list[int] = []
    while len(times) < steps + 1:
        total, t0 = sum(lengths.values()), time.perf_counter()
        outputs = engine.step()
        elapsed = (time.perf_counter() - t0) * 1e3
        if len(started) == len(ids):  # every prefill was done before this step: a pure decode
            times.append(elapsed)
            totals.append(total)
        for out in outputs:
            if out.finished:
                raise ProfileError(f"decode point batch={len(ids)}: {out.request_id} ended early "
                                   f"({out.end.finish_reason}); its batch is not the one measured")
            started.add(out.request_id)
            lengths[out.request_id] += len(out.token_ids)
    # The first pure decode step is untimed (it may still pay for the last prefill's layout). The
    # steps do the same work, so their spread is other processes: take the lower quartile.
    low = statistics.quantiles(times[1:], n=4)[0] if steps > 1 else times[1]
    return DecodeSample(len(ids), round(statistics.fmean(totals[1:])), low)
