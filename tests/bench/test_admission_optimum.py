"""The offline optimum beside a live admission replay (bench/admission_optimum.py): the shape from
the serve flags, prefix hits from the prompts the server saw, the % and the gap on hand-made
records, the table's columns, a server without the cost-model route."""

from __future__ import annotations

import numpy as np
import pytest

from halfmoon.bench import admission_report as ar
from halfmoon.bench import serve_metrics as sm
from halfmoon.bench.admission_optimum import fetch_cost_model, prefills, replay_optimum, shape
from halfmoon.conductor.cost_model import CostModel
from halfmoon.core.errors import ConfigError

# prefill = n new tokens ms (+ nothing for cached ones); decode step 10 ms whatever the batch
FLAT = CostModel((0.0, 1.0, 0.0, 0.0), (10.0, 0.0, 0.0), 1e9, 1000, "test: flat")
SLO = sm.Slo(ttft_ms=1300.0, tbt_ms=100.0)


def sent(index: int, prompt: int, ttft_s: float | None, status: str = "ok") -> sm.RequestRecord:
    """A request arriving at 0 s with 2 output tokens, the second 10 ms after the first."""
    times = [] if ttft_s is None else [ttft_s, ttft_s + 0.01]
    return sm.RequestRecord(index, 0.0, prompt, 2, sent_s=0.0, token_times=times, status=status)


def test_shape_comes_from_the_serve_flags() -> None:
    assert shape("--prefill 2 --decode 3 --worker-threads 1") == (2, 3, False)
    assert shape("--worker-threads 1") == (1, 1, False)
    assert shape("--colocated --threads 2") == (1, 1, True)
    assert shape(None) == (1, 1, False)


def test_a_prompt_of_the_replay_gives_its_hit_only_if_admitted_an_earlier_replay_always() -> None:
    a, b = np.arange(100), np.concatenate([np.arange(60), np.full(40, -1)])
    # b shares a's first 60 tokens: 40 ms if a was admitted, 100 cold
    assert prefills(FLAT, [a, b], []) == [(100.0, None, ()), (40.0, 100.0, ((0, 40.0),))]
    assert prefills(FLAT, [a], [a]) == [(1.0, None, ())]  # never the whole prompt: its last token is computed


def test_a_policy_that_admits_in_order_beside_the_optimum_that_skips_the_long_prompt() -> None:
    """Three at once: 1000, 600, 600 prompt tokens (ms of prefill), TTFT 1300 ms. The policy
    admitted the long one (served) and refused the others; the optimum serves the two short."""
    records = [sent(0, 1000, 1.01), sent(1, 600, None, "rejected"), sent(2, 600, None, "rejected")]
    prompts = [np.arange(1000), np.arange(1, 601), np.arange(2, 602)]
    o = replay_optimum(records, prompts, [], FLAT, "--prefill 1 --decode 1", SLO, window_s=10.0)
    assert (o["served"], o["method"], o["pct_of_optimum"], o["reference"]) == (2, "exact", 50.0, "1P1D")
    assert o["gap"] == {"optimum_only": 2, "optimum_only_by_outcome": {"refused": 2}, "policy_only": 1}
    colocated = replay_optimum(records, prompts, [], FLAT, "--colocated", SLO, window_s=10.0)
    assert colocated["method"] == "upper bound" and "co-located" in colocated["reference"]
    run = {"mode": "cluster", "policy": "predictive", "load": 1.0, "optimum": o,
           "metrics": {"offered_rps": 0.3, "requests": 3, "rejected": 2, "errors_5xx": 0, "timed_out": 0,
                       "goodput_rps": 0.1, "slo_met": 1, "admitted_ok_pct": 100.0, "wasted_prefill_tokens": 0,
                       "ttft_ms": {"p90": 1010.0}, "tbt_ms": {"p90": 10.0}, "ttft_prediction_error_pct": None,
                       "tbt_prediction_error_pct": None},
           "index": {"heartbeat_max_gap_s": None, "resyncs": None, "scrape_error": None}}
    table = ar.render_mode_table([run]).splitlines()
    assert "optimum" in table[0] and "%opt" in table[0]
    assert table[2].split()[9:12] == ["1", "2", "50.0"]  # met, optimum, %opt after %best
    (line,) = ar.gap_lines({"modes": {"cluster": {"runs": [run]}}})
    assert "serves 2 it did not (refused 2); it serves 1 outside" in line


def test_a_server_without_the_route_is_a_named_error() -> None:
    with pytest.raises(ConfigError, match="cost model"):
        fetch_cost_model("http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ConfigError, match="no HTTP URL"):
        fetch_cost_model(None)
