"""The `soak` marker: the long soak (`halfmoon bench soak --minutes 30`) runs only when asked
(`pytest -m soak` or HALFMOON_SOAK=1); the default suite skips it with that reason and runs the
short version in test_soak.py instead."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    asked = "soak" in (config.getoption("-m") or "") and "not soak" not in (config.getoption("-m") or "")
    if asked or os.environ.get("HALFMOON_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="the long soak: run with `pytest -m soak` or HALFMOON_SOAK=1")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)
