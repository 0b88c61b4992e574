"""Backend selection never falls back silently; the transport config validates itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.transport.test_faults import REPO
from transport import get_backend
from transport.config import TransportConfig, TransportConfigError
from transport.errors import BackendUnavailableError
from transport.tcp import TcpBackend

WITHOUT_UCXX = "import sys; sys.modules['ucxx'] = None\nfrom transport import get_backend\n"


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_ucxx_asked_for_but_unavailable_fails_at_startup() -> None:
    proc = run_python(WITHOUT_UCXX + "get_backend('ucxx')")
    assert proc.returncode != 0
    assert "BackendUnavailableError" in proc.stderr and "transport backend 'ucxx' is unavailable" in proc.stderr


def test_auto_without_ucxx_says_so_and_uses_tcp() -> None:
    proc = run_python(WITHOUT_UCXX + "print(type(get_backend('auto')).__name__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "TcpBackend"
    assert "ucxx" in proc.stderr and "using the tcp backend" in proc.stderr


def test_auto_with_ucxx_picks_ucxx() -> None:
    assert get_backend("auto").name == "ucxx"


def test_unknown_backend() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend"):
        get_backend("carrier-pigeon")


@pytest.mark.parametrize("kwargs,field", [
    ({"backend": "smoke-signals"}, "backend"),
    ({"port": 70000}, "port"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"max_inflight_mb": -1}, "max_inflight_mb"),
    ({"backend": "tcp", "ucx_tls": "tcp"}, "ucx_tls"),
])
def test_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(TransportConfigError, match=field):
        TransportConfig(**kwargs)


def test_secret_from_file_then_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HALFMOON_KV_SECRET", raising=False)
    assert TransportConfig().secret() is None
    monkeypatch.setenv("HALFMOON_KV_SECRET", "from-env")
    assert TransportConfig().secret() == b"from-env"
    path = tmp_path / "kv-secret"
    path.write_text("from-file\n")
    assert TransportConfig(secret_file=str(path)).secret() == b"from-file"
    path.write_text("")
    with pytest.raises(TransportConfigError, match="empty"):
        TransportConfig(secret_file=str(path)).secret()
    with pytest.raises(TransportConfigError, match="No such file"):
        TransportConfig(secret_file=str(tmp_path / "missing")).secret()


def test_make_backend() -> None:
    assert isinstance(TransportConfig(backend="tcp").make_backend(), TcpBackend)
