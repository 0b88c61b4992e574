"""The dashboard's browser: Debian's chromium driven by Playwright, one per test module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.dashboard.browser_support import CHROMIUM_ARGS


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("chromium is not installed: the dashboard's browser tests need it "
                    "(`make test` installs it as root via deploy/install_browser.sh; or apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
