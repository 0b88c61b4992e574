"""The native polling slice's contract, measured in a process of its own (tests only).

    python -m tests.transport.ucxspin_probe  ->  one JSON object on stdout

It makes a second UCX context and worker of its own, which must not share a process with the
ucxx runtime of the test session (UCX objects destroyed by the garbage collector while the
runtime's worker is progressed on its owner thread are not safe).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def main() -> None:
    import ucxx._lib.libucxx as u

    from halfmoon.transport import _ucxspin

    from halfmoon.transport.ucxx_runtime import ucp_progress_address

    fn = ucp_progress_address()
    worker = u.UCXWorker(u.UCXContext(feature_flags=(u.Feature.TAG, u.Feature.STREAM)))
    r, w = os.pipe()
    out: dict[str, Any] = {}

    start = time.perf_counter()  # an idle worker: polled for the whole budget, then 0
    out["idle_events"] = _ucxspin.spin(fn, worker.handle, r, 30_000_000)
    out["idle_s"] = time.perf_counter() - start

    os.write(w, b"x")  # a queued post (the wake fd readable) ends a 10 s slice at once
    start = time.perf_counter()
    out["woken_events"] = _ucxspin.spin(fn, worker.handle, r, 10_000_000_000)
    out["woken_s"] = time.perf_counter() - start
    os.read(r, 1)

    accepted: list[Any] = []  # a connection to a listener of the same worker: events counted
    listener = u.UCXListener.create(
        worker, 0, lambda request: accepted.append(listener.create_endpoint_from_conn_request(request, True)))
    endpoint = u.UCXEndpoint.create(worker, "127.0.0.1", listener.port, True)
    events, deadline = 0, time.monotonic() + 10.0
    while not accepted and time.monotonic() < deadline:
        events += _ucxspin.spin(fn, worker.handle, r, 100_000_000)
    out["connect_events"], out["accepted"] = events, len(accepted)
    print(json.dumps(out), flush=True)
    del endpoint
    os._exit(0)  # no teardown of UCX objects at interpreter exit


if __name__ == "__main__":
    main()
