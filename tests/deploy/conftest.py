"""The chart's renderer, one per test module (tests/deploy/chart.py)."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm  # helm-python-sdk: the [test] extra
import pytest

from tests.deploy.chart import CHART, Renderer


@pytest.fixture(scope="module")
def renderer() -> Iterator[Renderer]:
    with helm.Chart.load(str(CHART)) as chart:
        yield Renderer(chart)
