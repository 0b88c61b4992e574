"""The embedded Redis' supervisor (kvpool/redis_server.py): a killed server comes back on the
same port; an explicit stop stays stopped."""

from __future__ import annotations

import os
import signal

from halfmoon.kvpool.redis_server import EmbeddedRedis, ping
from tests.waiting import wait_until


def test_a_supervised_server_comes_back_after_kill_9_and_stays_down_after_stop() -> None:
    server = EmbeddedRedis().start()
    try:
        server.supervise(interval_s=0.05)
        first = server._proc.pid  # noqa: SLF001 - the process is what the fault kills
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: server.running and server._proc.pid != first and ping(server.port),  # noqa: SLF001
                   timeout_s=10, what="the supervisor restarting redis-server")
    finally:
        server.stop()
    assert not server.running and not ping(server.port)
