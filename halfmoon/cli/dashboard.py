"""`halfmoon dashboard`: the address of a running cluster's operator dashboard (checked: the
Conductor must answer there), and with `--open` the browser opened on it.

    halfmoon dashboard                      # http://127.0.0.1:8000/dashboard
    halfmoon dashboard --url http://head:8000 --open
"""

from __future__ import annotations

import argparse
import os

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "HALFMOON_URL"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL),
                   help=f"the Conductor's HTTP address, as `halfmoon serve` printed it [env {URL_ENV}]")
    p.add_argument("--open", action="store_true", help="open it in the default browser too")
    p.add_argument("--timeout-s", type=float, default=5.0, help="how long to wait for the Conductor to answer")


def env_dests() -> set[str]:
    return set()


def run(args: argparse.Namespace) -> int:
    import webbrowser

    import httpx

    from halfmoon.core.errors import HalfmoonError

    base = args.url.rstrip("/")
    try:
        health = httpx.get(f"{base}/health", timeout=args.timeout_s)
        page = httpx.get(f"{base}/dashboard", timeout=args.timeout_s)
    except httpx.HTTPError as e:
        raise HalfmoonError(f"no Halfmoon server answers at {base} ({e}); start one with `halfmoon serve` "
                            f"or pass --url") from None
    if page.status_code == 404:
        raise HalfmoonError(f"the server at {base} serves no dashboard (started with --no-dashboard?)")
    state = health.json().get("status", "?") if health.headers.get("content-type", "").startswith(
        "application/json") else f"HTTP {health.status_code}"
    url = f"{base}/dashboard"
    note = "; sign in with an API token" if page.status_code == 401 else ""
    print(f"{url}   (cluster {state}{note})")
    if args.open and not webbrowser.open(url):
        print("halfmoon: no browser could be opened here; open the address above yourself")
    return 0
