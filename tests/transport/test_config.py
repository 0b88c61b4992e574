"""Backend selection never falls back silently; the transport config validates itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.transport.helpers import REPO
from halfmoon.transport import get_backend
from halfmoon.transport.config import TransportConfig, TransportConfigError
from halfmoon.transport.errors import BackendUnavailableError
from halfmoon.transport.tcp import TcpBackend

WITHOUT_UCXX = "import sys; sys.modules['ucxx'] = None\nfrom halfmoon.transport import get_backend\n"


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


# tcp only: a ucxx listener closed inside a process keeps its port (UCXXBusyError) until the
# process exits; a restarted decode worker is a new process, so that case is the tcp one here.
@pytest.mark.parametrize("backend_name", ["tcp"])
def test_peer_cache_reuses_and_reconnects(backend_name: str) -> None:
    from tests.transport.conftest import FINGERPRINT, kv_tensor
    from tests.waiting import poll
    from halfmoon.transport import KVLayout, KVReceiver
    from halfmoon.transport.peers import KVPeers

    src, dst = kv_tensor(8, seed=1), kv_tensor(8)
    layout = KVLayout.of(src, FINGERPRINT)
    backend = get_backend(backend_name)
    first = KVReceiver(dst, layout, backend, timeout=5.0).start()
    port = int(first.address.rsplit(":", 1)[1])
    peers = KVPeers(src, layout, TransportConfig(backend=backend_name, timeout_s=5.0), backend)
    try:
        sender = peers.sender(first.address)
        assert peers.sender(first.address) is sender  # cached
        first.close()  # the decode worker restarts on the same port
        assert poll(lambda: sender.broken is not None, 5.0)
        second = KVReceiver(dst, layout, backend, port=port, timeout=5.0).start()
        try:
            again = peers.sender(second.address)
            assert again is not sender and peers.reconnects == 1
            second.expect("r", [1])
            stream = again.open("r", [1])
            stream.send_layer(0, [3], [1])
            stream.finish()
            stream.wait(10)
            assert torch.equal(dst[0, :, 1], src[0, :, 3])
        finally:
            second.close()
    finally:
        peers.close()



def test_advertised_address_replaces_only_a_wildcard_bind() -> None:
    from halfmoon.transport.config import advertised_address

    assert advertised_address("tcp://127.0.0.1:7001", "127.0.0.1") == "tcp://127.0.0.1:7001"
    host, port = advertised_address("tcp://0.0.0.0:7001", "0.0.0.0").rsplit(":", 1)
    assert port == "7001" and host not in ("0.0.0.0", "") and "://" not in host
