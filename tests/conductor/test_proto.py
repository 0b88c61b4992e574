"""The generated stubs in halfmoon/v1 are what `make proto` makes from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = sorted((ROOT / "proto" / "halfmoon" / "v1").glob("*.proto"))


def test_stubs_are_fresh(tmp_path: Path) -> None:
    assert PROTOS, "no .proto files under proto/halfmoon/v1"
    # The same command as `make proto`, into a scratch directory.
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iproto", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *(str(p.relative_to(ROOT)) for p in PROTOS)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc generated nothing"
    stale = [str(rel) for rel in generated if (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"stale stubs (run `make proto` and commit): {stale}"


def test_make_proto_runs_the_same_command() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "-m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=." in makefile
