"""The dashboard's browser tests' shared pieces: viewports, the API token the served cluster
takes, and `Page` (a Playwright page that records console errors, signs in, takes screenshots and
checks for sideways scrolling). The `browser` fixture is in conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("HALFMOON_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "dashboard"
TOKEN = "browser-test-token"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
WIDE, NARROW = {"width": 1280, "height": 800}, {"width": 390, "height": 844}


class Page:
    """A browser page that records console errors and uncaught exceptions."""

    def __init__(self, browser: object, viewport: dict[str, int]) -> None:
        self.context = browser.new_context(viewport=viewport)  # type: ignore[attr-defined]
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def sign_in(self, url: str) -> None:
        response = self.page.goto(url + "/dashboard")
        assert response is not None and response.status == 401
        self.errors.clear()  # the 401 itself is logged by Chromium as a failed resource load
        self.page.fill("#token", TOKEN)
        self.page.press("#token", "Enter")
        self.page.wait_for_selector('[data-worker="prefill-0"]', timeout=30_000)

    def shot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def no_horizontal_scroll(self) -> None:
        widths = self.page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"the page scrolls sideways: {widths[0]} px wide in a {widths[1]} px window"

    def close(self) -> None:
        self.context.close()
