"""The router follows Mooncake's Algorithm 1 on a synthetic cost model (pure, no engine)."""

from __future__ import annotations

import pytest

from halfmoon.conductor.cost_model import CostModel
from halfmoon.conductor.errors import ServiceUnavailableError, status_of
from halfmoon.conductor.prediction import DecodeJob, DecodeLoadPredictor
from halfmoon.conductor.router import (DecodeView, NoDecodeCapacityError,
                              NoWorkerAvailableError,
                              PrefillView, RouteRequest, Router)

BS = 16
# Shaped like a real profile: a constant, linear, attention (n*c, n^2) terms; 0.1 ms/token fetch.
COST = CostModel(prefill_coef=(20.0, 2.0, 0.001, 0.002), decode_coef=(30.0, 0.5, 0.01),
                 transfer_bytes_per_s=1e7, kv_bytes_per_token=1000)
# Integer-exact costs, for ties: prefill = n ms, decode step = b ms, transfer 1 ms per 1000 tokens.
EXACT = CostModel(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(0.0, 1.0, 0.0),
                  transfer_bytes_per_s=1e6, kv_bytes_per_token=1)
NO_PULL = 1e9  # a balancing threshold nothing exceeds: every worker computes what it lacks
ROOMY = DecodeView("d0", running=0, context_tokens=0, free_blocks=10_000)

# A holds 512 of a 1024-token prompt, B nothing: A wins until its queue outweighs the 512 tokens
# it would not compute.
PROMPT, HIT = 1024, 512
BREAK_EVEN_MS = COST.est_prefill_ms(PROMPT, 0) - COST.est_prefill_ms(PROMPT - HIT, HIT)


def prefill_pair(queue_a: float) -> list[PrefillView]:
    return [PrefillView("A", HIT, queue_a), PrefillView("B", 0, 0.0)]


@pytest.mark.parametrize("delta_ms,winner", [(-BREAK_EVEN_MS, "A"), (-1.0, "A"), (-1e-3, "A"),
                                             (1e-3, "B"), (1.0, "B"), (1000.0, "B")])
def test_longer_match_wins_until_its_queue_outweighs_it(delta_ms: float, winner: str) -> None:
    router = Router(COST, BS, balancing_threshold=NO_PULL)
    req = RouteRequest(PROMPT, 16, best_len=HIT, best_holder="A")
    plan = router.route(req, prefill_pair(BREAK_EVEN_MS + delta_ms), [ROOMY])
    assert plan.prefill_id == winner
    assert plan.prefix_len == (HIT if winner == "A" else 0)
    assert plan.fetch_from is None and plan.fetch_tokens == 0
    ttft = {e.worker_id: e.ttft_ms for e in plan.per_worker}
    assert ttft["A"] == pytest.approx(BREAK_EVEN_MS + delta_ms + COST.est_prefill_ms(PROMPT - HIT, HIT))
    assert ttft["B"] == pytest.approx(COST.est_prefill_ms(PROMPT, 0))
    assert plan.predicted_ttft_ms == min(ttft.values())


def test_break_even_is_positive_and_within_the_prompt() -> None:
    assert 0 < BREAK_EVEN_MS < COST.est_prefill_ms(PROMPT, 0)


@pytest.mark.parametrize("own,best,threshold,fetch", [
    (0, 512, 2.0, 512),      # 512 / max(0, one block) = 32 > 2: pull everything
    (128, 512, 2.0, 384),    # 4 > 2: pull the missing 384
    (256, 512, 2.0, 0),      # exactly 2 is not above the threshold: compute
    (16, 32, 2.0, 0),        # 32 / 16 = 2: compute
    (16, 48, 2.0, 32),       # 3 > 2
    (0, 16, 0.5, 16),        # a low threshold pulls even one block
    (128, 512, 4.0, 0),      # 4 is not above 4
])
def test_pull_plan_above_the_balancing_threshold(own: int, best: int, threshold: float, fetch: int) -> None:
    router = Router(COST, BS, balancing_threshold=threshold)
    req = RouteRequest(PROMPT, 16, best_len=best, best_holder="H")
    plan = router.route(req, [PrefillView("P", own, 0.0)], [ROOMY])
    prefix = own + fetch
    assert (plan.prefill_id, plan.prefix_len, plan.fetch_tokens) == ("P", prefix, fetch)
    assert plan.fetch_from == ("H" if fetch else None)
    expected = COST.est_prefill_ms(PROMPT - prefix, prefix) + COST.est_transfer_ms(fetch)
    assert plan.predicted_ttft_ms == pytest.approx(expected)
    (estimate,) = plan.per_worker
    assert estimate.transfer_ms == pytest.approx(fetch * 0.1)


def test_pulling_beats_a_long_queue_on_the_holder() -> None:
    """The holder is busy; an idle worker pulls the prefix instead of computing it: a hot prefix
    gets replicated to where requests can run."""
    router = Router(COST, BS, balancing_threshold=2.0)
    req = RouteRequest(PROMPT, 16, best_len=HIT, best_holder="A")
    plan = router.route(req, [PrefillView("A", HIT, 5000.0), PrefillView("B", 0, 0.0)], [ROOMY])
    assert (plan.prefill_id, plan.fetch_from, plan.fetch_tokens, plan.prefix_len) == ("B", "A", HIT, HIT)


def test_the_holder_itself_never_fetches() -> None:
    router = Router(COST, BS, balancing_threshold=0.5)
    req = RouteRequest(PROMPT, 16, best_len=HIT, best_holder="A")
    plan = router.route(req, [PrefillView("A", HIT, 0.0)], [ROOMY])
    assert (plan.prefix_len, plan.fetch_from, plan.fetch_tokens) == (HIT, None, 0)


@pytest.mark.parametrize("prompt_len,usable", [(512, 496), (513, 512), (17, 16), (16, 0), (1, 0)])
def test_a_prefix_never_covers_the_last_token(prompt_len: int, usable: int) -> None:
    router = Router(COST, BS, balancing_threshold=2.0)
    req = RouteRequest(prompt_len, 16, best_len=prompt_len // BS * BS, best_holder="H")
    plan = router.route(req, [PrefillView("P", prompt_len // BS * BS, 0.0)], [ROOMY])
    assert plan.prefix_len == usable
    assert plan.per_worker[0].prefill_ms == pytest.approx(COST.est_prefill_ms(prompt_len - usable, usable))


def test_dead_workers_are_skipped() -> None:
    router = Router(COST, BS, balancing_threshold=NO_PULL)
    req = RouteRequest(PROMPT, 16, best_len=HIT, best_holder="A")
    prefill = [PrefillView("A", HIT, 0.0, alive=False), PrefillView("B", 0, 10.0)]
    decode = [DecodeView("d-dead", 0, 0, 10_000, alive=False), DecodeView("d-busy", 30, 9000, 200)]
    plan = router.route(req, prefill, decode)
    assert (plan.prefill_id, plan.decode_id) == ("B", "d-busy")
    assert [e.worker_id for e in plan.per_worker] == ["B"]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_prefill_ties_go_to_the_shorter_queue_then_the_lower_id(order: list[int]) -> None:
    router = Router(EXACT, BS, balancing_threshold=NO_PULL)
    req = RouteRequest(1024, 16, best_len=512, best_holder="p2")
    # All three predict exactly 1024 ms; p1 and p0 have no queue.
    views = [PrefillView("p1", 0, 0.0), PrefillView("p0", 0, 0.0), PrefillView("p2", 512, 512.0)]
    plan = router.route(req, [views[i] for i in order], [ROOMY])
    assert {e.ttft_ms for e in plan.per_worker} == {1024.0}
    assert plan.prefill_id == "p0"
    assert [e.worker_id for e in plan.per_worker] == [views[i].worker_id for i in order]


def test_decode_goes_to_the_smallest_predicted_tbt() -> None:
    router = Router(COST, BS)
    req = RouteRequest(1000, 100)
    decode = [DecodeView("busy", running=20, context_tokens=20_000, free_blocks=5000),
              DecodeView("long", running=4, context_tokens=30_000, free_blocks=5000),
              DecodeView("light", running=8, context_tokens=4_000, free_blocks=100)]
    plan = router.route(req, [PrefillView("P", 0, 0.0)], decode)
    tbt = {d.worker_id: COST.est_decode_step_ms(d.running + 1, d.context_tokens + 1000) for d in decode}
    assert plan.decode_id == min(tbt, key=tbt.__getitem__) == "light"
    assert plan.predicted_tbt_ms == pytest.approx(tbt["light"])


def test_decode_needs_room_for_prompt_and_output() -> None:
    router = Router(COST, BS)
    req = RouteRequest(1000, 100)  # ceil(1100 / 16) = 69 blocks
    assert router.blocks_needed(req) == 69
    idle_but_full = DecodeView("full", running=0, context_tokens=0, free_blocks=68)
    just_fits = DecodeView("fits", running=30, context_tokens=30_000, free_blocks=69)
    assert router.route(req, [PrefillView("P", 0, 0.0)], [idle_but_full, just_fits]).decode_id == "fits"


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]])
def test_decode_ties_go_to_more_free_blocks_then_the_lower_id(order: list[int]) -> None:
    router = Router(EXACT, BS)
    decode = [DecodeView("d1", 3, 0, 500), DecodeView("d2", 3, 0, 900), DecodeView("d0", 3, 0, 900)]
    plan = router.route(RouteRequest(100, 10), [PrefillView("P", 0, 0.0)], [decode[i] for i in order])
    assert plan.decode_id == "d0"
    assert plan.predicted_tbt_ms == 4.0


def test_no_live_prefill_worker() -> None:
    router = Router(COST, BS)
    with pytest.raises(NoWorkerAvailableError, match="no live prefill worker"):
        router.route(RouteRequest(100, 10), [PrefillView("P", 0, 0.0, alive=False)], [ROOMY])
    with pytest.raises(NoWorkerAvailableError):
        router.route(RouteRequest(100, 10), [], [ROOMY])


def test_no_decode_worker_fits() -> None:
    router = Router(COST, BS)
    decode = [DecodeView("small", 0, 0, 7), DecodeView("dead", 0, 0, 10_000, alive=False)]
    with pytest.raises(NoDecodeCapacityError, match=r"8 free KV blocks.*most free: 7") as err:
        router.route(RouteRequest(100, 28), [PrefillView("P", 0, 0.0)], decode)
    assert status_of(err.value).http == 429 and err.value.retry_after_s > 0  # capacity, not an outage
    with pytest.raises(NoWorkerAvailableError, match="no live decode worker") as down:
        router.route(RouteRequest(100, 28), [PrefillView("P", 0, 0.0)], decode[1:])
    assert isinstance(down.value, ServiceUnavailableError) and status_of(down.value).http == 503


@pytest.mark.parametrize("make", [
    lambda: RouteRequest(0, 10),
    lambda: RouteRequest(10, -1),
    lambda: RouteRequest(100, 10, best_len=32),  # a match with no holder
    lambda: PrefillView("P", -16, 0.0),
    lambda: PrefillView("P", 0, float("nan")),
    lambda: DecodeView("D", 0, 0, -1),
    lambda: Router(COST, 0),
    lambda: Router(COST, BS, balancing_threshold=0.0),
])
def test_bad_inputs_are_refused(make) -> None:
    with pytest.raises(ValueError):
        make()


# ---------------------------------------------------------------------- DecodeLoadPredictor

# A constant 10 ms decode step: a job with r tokens left stays r * 10 ms.
FLAT = CostModel(prefill_coef=(0.0, 1.0, 0.0, 0.0), decode_coef=(10.0, 0.0, 0.0),
                 transfer_bytes_per_s=1e9, kv_bytes_per_token=1)
PREDICT = DecodeLoadPredictor(FLAT)


def test_an_idle_worker_holds_just_the_request() -> None:
    load = PREDICT.predict([], arrival_ms=500.0, prompt_len=300)
    assert (load.batch, load.context_tokens, load.tbt_ms) == (1, 300, 10.0)


@pytest.mark.parametrize("arrival_ms,batch,context", [
    (0.0, 2, 100 + 50),      # the running job is still there, nothing decoded yet
    (49.0, 2, 104 + 50),     # 4 steps done by then
    (50.0, 1, 50),           # 5 steps x 10 ms: it has left
    (200.0, 1, 50),
])
def test_running_requests_leave_after_their_remaining_tokens(arrival_ms: float, batch: int, context: int) -> None:
    load = PREDICT.predict([DecodeJob(0.0, 100, remaining_tokens=5)], arrival_ms, prompt_len=50)
    assert (load.batch, load.context_tokens) == (batch, context)


@pytest.mark.parametrize("arrival_ms,batch", [(99.0, 1), (100.0, 2), (150.0, 2), (299.0, 2), (300.0, 1)])
def test_requests_in_prefill_join_when_their_prefill_ends(arrival_ms: float, batch: int) -> None:
    incoming = DecodeJob(joins_at_ms=100.0, context_tokens=200, remaining_tokens=20)
    load = PREDICT.predict([incoming], arrival_ms, prompt_len=10)
    assert load.batch == batch


def test_predicted_load_differs_from_the_load_now() -> None:
    """Now: 3 running requests about to finish, 2 long ones still in prefill. By the time a
    request with a 1 s TTFT arrives the batch is the two long ones (plus itself), not the three."""
    cost = CostModel((0.0, 1.0, 0.0, 0.0), (5.0, 2.0, 0.001), 1e9, 1)
    jobs = [DecodeJob(0.0, 500, 3)] * 3 + [DecodeJob(800.0, 4000, 500)] * 2
    predictor = DecodeLoadPredictor(cost)
    step = predictor.step_ms_now(jobs)
    assert step == pytest.approx(cost.est_decode_step_ms(3, 1500))
    load = predictor.predict(jobs, arrival_ms=1000.0, prompt_len=1000)
    done = int(200.0 / step)
    assert (load.batch, load.context_tokens) == (3, 2 * (4000 + done) + 1000)
    assert load.tbt_ms == pytest.approx(cost.est_decode_step_ms(3, 2 * (4000 + done) + 1000))
