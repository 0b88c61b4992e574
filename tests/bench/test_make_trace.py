"""`python -m halfmoon.bench.make_trace`: the bundled sample trace is its output at its defaults, byte for
byte, and what it writes reads back as a valid Mooncake trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from halfmoon.bench.make_trace import main
from halfmoon.sim.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "halfmoon" / "bench" / "data" / "sample_trace.jsonl"


def test_the_bundled_sample_is_the_commands_output_at_its_defaults(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["--out", str(out)]) == 0
    assert out.read_bytes() == SAMPLE.read_bytes()


def test_the_module_writes_a_trace_to_stdout_that_reads_back(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "halfmoon.bench.make_trace", "--requests", "20", "--seed", "3",
                           "--sessions-per-s", "2", "--turns", "2,3"], cwd=ROOT, capture_output=True,
                          text=True, check=True, timeout=60)
    path = tmp_path / "t.jsonl"
    path.write_text(done.stdout)
    rows = list(read_trace(path))
    assert len(rows) == 20 and [r.timestamp for r in rows] == sorted(r.timestamp for r in rows)
    # every session has 2-3 turns, each extending the last: some prompt starts with another's blocks
    assert any(r.hash_ids[:len(s.hash_ids) - 1] == s.hash_ids[:-1] and len(s.hash_ids) > 1
               for r in rows for s in rows if r is not s)


def test_a_bad_shape_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--think-s", "9"])
    assert e.value.code == 2 and "--think-s" in capsys.readouterr().err
