"""One namespace (issue 45): the wheel installs `halfmoon` and nothing else at the top of
site-packages, so Halfmoon coexists with any package of its users' environments. Built here as
`pip wheel .` builds it, installed NON-editable into a fresh venv that also holds transformers and
Hugging Face's `kernels` (installed there with pip; the other dependencies come from the
project's venv through a path file, so the test needs no network beyond the package index),
then `halfmoon serve` from that venv answers a request, and `import kernels` is still Hugging
Face's. (Before, Halfmoon's own `kernels` package and Hugging Face's shared one name: a wheel
install wrote both into one `site-packages/kernels/`.)
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import openai
import pytest

from tests.e2e.support import wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
NEIGHBOURS = ("transformers", "kernels")  # Hugging Face's: `kernels` once collided with ours


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True, timeout=600, capture_output=True)
    (built,) = out.glob("halfmoon-*.whl")
    return built


def test_the_wheel_holds_only_the_halfmoon_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"halfmoon"}, sorted(tops)
    for data in ("halfmoon/kvpool/lua/", "halfmoon/sim/profiles/", "halfmoon/bench/data/",
                 "halfmoon/dashboard/static/"):
        assert any(n.startswith(data) for n in names), f"package data missing from the wheel: {data}"
    assert any(n.startswith("halfmoon/kernels/_paged_attn") and n.endswith(".so") for n in names)


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv: transformers and Hugging Face's kernels installed in it, then the wheel."""
    root = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    own = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True).stdout.strip())
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in NEIGHBOURS]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", *pins], check=True, timeout=600)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=600)
    # every other dependency from the project's venv, after this venv's own packages
    (own / "zz-project-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return root


def _run(venv: Path, code: str, tmp: Path) -> str:
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp, capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_kernels_is_still_hugging_faces_and_halfmoon_comes_from_the_wheel(venv: Path, tmp_path: Path) -> None:
    out = _run(venv, "import kernels, halfmoon.kernels.attention as a, halfmoon.engine.engine\n"
                     "print(kernels.__file__); print(a.__file__); print(hasattr(kernels, 'get_kernel'))\n"
                     "import importlib.util as u\n"
                     "print([m for m in ('core', 'engine', 'kvpool', 'transport', 'conductor', 'sim', 'bench', 'cli')"
                     " if u.find_spec(m) is not None])\n", tmp_path)
    hf, ours, api, tops = out.splitlines()
    assert hf.startswith(str(venv)) and "/site-packages/kernels/" in hf, hf
    assert ours.startswith(str(venv)) and "/site-packages/halfmoon/kernels/" in ours, ours  # not the repo's
    assert api == "True"  # Hugging Face's API, not a merged folder
    assert tops == "[]", f"generic top-level packages importable: {tops}"


def test_halfmoon_serve_from_the_wheel_answers(venv: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(venv / "bin" / "halfmoon"), "serve", "--grpc-port", "0", "--http-port", "0"],
                                cwd=tmp_path, stdout=out, stderr=out, text=True, start_new_session=True, env=env)
    try:
        http = wait_for_log(proc, log, r"listening grpc=(\S+) http=(\S+)", timeout=600).group(2)
        client = openai.OpenAI(base_url=http + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8)
        assert chat.choices[0].message.content
        assert str(ROOT / "halfmoon") not in log.read_text()  # nothing ran from the checkout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
