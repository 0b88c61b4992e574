"""`halfmoon bench engine`: the report is complete and self-consistent; nothing here is timed.

The end-to-end test runs `--quick --threads 1` (about 50 s, most of it loading both models): one
thread because on a shared 2-core machine two OpenMP threads next to other busy processes can
stall by orders of magnitude, and the test is about the report, not the speed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from halfmoon.bench.engine_bench import (
    QUICK,
    TARGETS,
    Sizes,
    TokenClock,
    kv_blocks_needed,
    main,
    make_workload,
    matching_prefix,
    parse_args,
    synthetic_ids,
)
from halfmoon.bench.report import Figure, render_table

FIGURES = {"w1_ttft_ms", "w1_tpot_ms", "w1_tok_s", "w2_tok_s", "w3_prefill_tok_s"}
FIGURE_KEYS = {"label", "unit", "halfmoon", "transformers", "ratio", "higher_is_better", "target",
               "met"}
TOP_KEYS = {"benchmark", "command", "date", "machine", "config", "workloads", "figures", "roofline",
            "checks", "targets_met", "method"}


# ---------------------------------------------------------------- pieces, no model

# A decode-step profile as bench/step_profile.py returns it (ms).
PROFILE = {"linear (weights)": 20.0, "python + scheduling": 1.0, "python + scheduling (profiled)": 3.0,
           "per-step overhead (outside the forward)": 0.5, "python + scheduling (timed kernels)": 2.0,
           "step (wall)": 30.0, "step (wall, profiled)": 34.0}


def test_synthetic_ids_are_deterministic_in_range_and_distinct_per_row() -> None:
    a = synthetic_ids(4, 64, 49152, seed=2)
    assert a == synthetic_ids(4, 64, 49152, seed=2)
    assert all(100 <= t < 49152 - 100 for row in a for t in row)
    assert len({tuple(row) for row in a}) == 4
    work = make_workload(QUICK, 49152)
    sizes = (len(work.w1), len(work.w2), len(work.w3))
    assert sizes == (QUICK.w1_prompt, QUICK.w2_batch, QUICK.w3_prompt)


def test_kv_cache_holds_the_whole_batch_at_once() -> None:
    assert kv_blocks_needed(Sizes(256, 128, 32, 256, 128, 2048)) == 32 * 24
    assert kv_blocks_needed(Sizes(16, 16, 1, 16, 16, 4096)) == 257  # 4097 tokens: W3 dominates


def test_figure_ratio_and_target() -> None:
    fast = Figure("w1_tok_s", "W1 output", "tok/s", 30.0, 10.0, True, 1.8)
    assert fast.ratio == 3.0 and fast.met is True
    assert Figure("x", "x", "tok/s", 10.0, 10.0, True, 1.8).met is False
    assert Figure("t", "TTFT", "ms", 5.0, 10.0, False).met is None
    table = render_table([fast], "transformers")
    assert "3.00x" in table and "met" in table


def test_token_clock_measures_from_the_call() -> None:
    clock = TokenClock()
    clock.start = 0.0
    clock.puts = [0.1, 1.0, 1.5, 2.0]  # prompt, then three tokens
    assert clock.ttft_ms() == pytest.approx(1000.0)
    assert clock.tpot_ms() == pytest.approx(500.0)
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--threads", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float16"])


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.timeout(240)  # ~50 s on an idle 2-core machine; a hang guard, not a speed check
def test_quick_json_report_is_complete_and_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    threads_before = torch.get_num_threads()
    assert main(["--quick", "--json", "--threads", "1"]) == 0
    assert torch.get_num_threads() == threads_before  # the run restores process settings
    report = json.loads(capsys.readouterr().out)

    assert TOP_KEYS <= report.keys()
    assert report["command"] == "halfmoon bench engine --quick --json --threads 1"
    assert {"cpu", "cores", "threads", "torch", "transformers"} <= report["machine"].keys()
    assert report["machine"]["threads"] == 1
    assert report["config"]["quick"] is True and report["config"]["dtype"] == "float32"
    w2 = {"requests": QUICK.w2_batch, "prompt_tokens": QUICK.w2_prompt,
          "output_tokens": QUICK.w2_output}
    assert report["workloads"]["w2"] == w2

    assert set(report["figures"]) == FIGURES
    for key, fig in report["figures"].items():
        assert FIGURE_KEYS <= fig.keys(), key
        assert fig["halfmoon"] > 0 and fig["transformers"] > 0, key
        assert math.isclose(fig["ratio"], fig["halfmoon"] / fig["transformers"], rel_tol=2e-3), key
        assert fig["target"] == TARGETS["float32"].get(key), key
        assert fig["met"] == (None if fig["target"] is None else fig["ratio"] >= fig["target"]), key
    assert report["targets_met"] == all(f["met"] is not False for f in report["figures"].values())

    roof = report["roofline"]
    assert roof["weight_bytes_per_step"] > 0 and roof["copy_bandwidth_gbps"] > 0
    tpot = report["figures"]["w1_tpot_ms"]["halfmoon"]
    assert roof["decode_step_ms"] == pytest.approx(tpot, rel=1e-3)
    fraction = roof["weights_gbps"] / roof["copy_bandwidth_gbps"]
    assert math.isclose(roof["fraction"], fraction, rel_tol=2e-3)

    prof = report["decode_step_profile_ms"]
    assert {"linear (weights)", "attention kernel", "python + scheduling", "python + scheduling (profiled)",
            "per-step overhead (outside the forward)", "python + scheduling (timed kernels)", "step (wall)",
            "step (wall, profiled)"} <= prof.keys()
    assert 0 < prof["per-step overhead (outside the forward)"] < prof["step (wall)"]
    # all of a step's Python is at least what it spends outside the forward, and less than the step
    glue = prof["python + scheduling (timed kernels)"]
    assert prof["per-step overhead (outside the forward)"] * 0.5 < glue < prof["step (wall)"]
    assert prof["python + scheduling"] <= prof["step (wall)"]

    checks = report["checks"]
    assert checks["w1_output_tokens"] == QUICK.w1_output and checks["w2_rows"] == QUICK.w2_batch
    assert 0 <= checks["w1_matching_prefix"] <= QUICK.w1_output


def test_one_section_per_quantization_with_its_targets_and_quality() -> None:
    """`--quantization none int4`: both engines against the one transformers run; the first
    engine's figures stay at the top level; a missed quality bound is a missed target."""
    from halfmoon.bench.engine_bench import (QUANTIZED_TARGETS, Measured, Results, Stream, build_report, engine_config,
                                    render_text)

    def measured(tok_s: float) -> Measured:
        return Measured(Stream(100.0, 1000 / tok_s, tok_s, [1, 2]), 10 * tok_s, [[1]], 400.0)

    args = parse_args(["--quick", "--quantization", "none", "int4"])
    quality = {"halfmoon int4": {"perplexity": 29.5, "fp32_perplexity": 28.5, "perplexity_change": 0.035,
                                 "bound": 0.03, "met": False, "text_tokens": 191, "greedy_identical": 1,
                                 "greedy_prompts": 8, "greedy_token_fraction": 0.5, "greedy_tokens": 32}}
    res = Results({"halfmoon": measured(30.0), "halfmoon int4": measured(80.0)}, measured(20.0),
                  {"halfmoon": "none", "halfmoon int4": "int4"}, {"halfmoon": 538_000_000, "halfmoon int4": 95_000_000},
                  20.0, {"halfmoon": PROFILE, "halfmoon int4": PROFILE}, quality)
    report, sections = build_report(args, "cmd", QUICK, engine_config("float32", QUICK, 1, 2048), res)
    assert list(report["systems"]) == ["halfmoon", "halfmoon int4"]
    assert report["figures"] == report["systems"]["halfmoon"]["figures"]
    int4 = report["systems"]["halfmoon int4"]
    assert int4["figures"]["w1_tok_s"]["ratio"] == pytest.approx(4.0)
    assert int4["figures"]["w1_tok_s"]["target"] == QUANTIZED_TARGETS["w1_tok_s"]
    assert int4["figures"]["w1_tok_s"]["met"] is True and int4["figures"]["w2_tok_s"]["target"] is None
    assert int4["roofline"]["weight_bytes_per_step"] == 95_000_000
    assert report["targets_met"] is False  # fp32's own targets are missed, and int4's quality bound
    text = render_text(report, sections)
    assert "per-step overhead outside the forward" in text and "0.50 ms (target < 1 ms: met)" in text
    assert "== halfmoon int4 (float32, quantization int4)" in text and "(bound 3%: MISSED)" in text

