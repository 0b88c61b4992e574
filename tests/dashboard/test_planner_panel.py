"""The dashboard's Planner panel in a real browser (Playwright + Debian's chromium) on a made-up
live document: a planner in `act` mode that held, flipped a worker and rolled the flip back, the
moves highlighted, the holds dimmed, the step plot drawn, nothing scrolling sideways on a phone.

The page and its scripts are the shipped files; only `/dashboard/api/live` is answered by the test
(Playwright's routing: no server, no cluster), so the timeline shows moves that a short live run
(tests/dashboard/test_browser.py: 1P1D, advise) cannot make.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from halfmoon.conductor.planner import Decision, Split
from halfmoon.conductor.planner_loop import PlannerSnapshot
from tests.dashboard.browser_support import NARROW, WIDE, Page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STATIC = Path(__file__).resolve().parents[2] / "halfmoon" / "dashboard" / "static"
ORIGIN = "http://halfmoon.test"  # routed by the test: never resolved
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
LONG_REASON = ("since the move to 1P3D SLO attainment fell to 61% from 93%: rolled back, 1P3D kept out "
               "for 300 s (a reason long enough to wrap on a phone)")


def live_document(planner: dict | None) -> dict:
    now = time.time()
    return {"now": now, "model": "smollm2", "mode": "cluster", "ready": True, "workers": [],
            "admission": {"policy": "predictive"}, "slo": {"ttft_ms": 2000, "tbt_ms": 150},
            "cluster": {"finished": 0}, "series": {"bin_s": 5, "t": []}, "lora": None, "planner": planner}


def planner_view() -> dict:
    """What dashboard/live.py sends for a planner that held, flipped a worker to decode and rolled it back."""
    hold = Decision(100.0, "hold", Split(2, 2), Split(2, 2), "2P2D serves the last window best")
    flip = Decision(130.0, "flip", Split(2, 2), Split(1, 3), "1P3D is predicted to serve +35% goodput over 2P2D",
                    "decode", 0.35, applied=True)
    back = Decision(190.0, "rollback", Split(1, 3), Split(2, 2), LONG_REASON, "prefill", applied=True)
    view = PlannerSnapshot("act", 30.0, Split(2, 2), Split(2, 2), (hold, flip, back),
                           {"hold": 1, "flip": 1, "rollback": 1}).view()
    now = time.time()
    for d in view["decisions"]:  # type: ignore[union-attr]
        d["time"] = now - 200 + d["at"]
    return view


def open_page(browser: object, viewport: dict[str, int], doc: dict) -> Page:
    """A page whose `/dashboard` and static files are the shipped ones and whose
    `/dashboard/api/live` answers `doc["live"]` (the test may change it)."""
    page = Page(browser, viewport)

    def answer(route: object) -> None:
        path = route.request.url.removeprefix(ORIGIN).split("?")[0]  # type: ignore[attr-defined]
        if path == "/dashboard/api/live":
            route.fulfill(status=200, content_type="application/json", body=json.dumps(doc["live"]))  # type: ignore[attr-defined]
            return
        name = "index.html" if path == "/dashboard" else path.removeprefix("/dashboard/static/")
        file = STATIC / name
        if "/" in name or not file.is_file():
            route.fulfill(status=404, body="")  # type: ignore[attr-defined]
            return
        route.fulfill(status=200, content_type=TYPES[file.suffix], body=file.read_text())  # type: ignore[attr-defined]

    page.page.route(f"{ORIGIN}/**", answer)
    return page


@pytest.fixture
def serve_page(browser: object) -> Iterator[tuple[Page, dict]]:
    doc = {"live": live_document(planner_view())}
    page = open_page(browser, WIDE, doc)
    yield page, doc
    page.close()


def test_the_timeline_highlights_moves_dims_holds_and_plots_the_pools(serve_page: tuple[Page, dict]) -> None:
    page, _ = serve_page
    p = page.page
    p.goto(f"{ORIGIN}/dashboard")
    p.wait_for_selector("#planner-table tbody tr[data-action]")
    assert p.locator("#planner-panel").is_visible()
    assert p.locator('[data-field="planner_mode"]').inner_text() == "act"
    assert p.locator('[data-field="planner_split"]').inner_text() == "2P2D"
    rows = p.locator("#planner-table tbody tr")
    assert [rows.nth(i).get_attribute("data-action") for i in range(3)] == ["rollback", "flip", "hold"]  # newest first
    assert rows.nth(1).get_attribute("class") == "move flip" and rows.nth(2).get_attribute("class") == "hold"
    cells = [rows.nth(1).locator("td").nth(i).inner_text() for i in range(5)]
    assert cells[1:4] == ["flip decode", "2P2D → 1P3D", "+35%"] and "goodput" in cells[4]
    # moved rows stand out, held ones are dimmed (still readable: #555 on white)
    colour = "(el) => getComputedStyle(el).backgroundColor"
    assert rows.nth(1).evaluate(colour) != rows.nth(2).evaluate(colour)
    assert rows.nth(2).locator("td").first.evaluate("(el) => getComputedStyle(el).color") == "rgb(85, 85, 85)"
    p.wait_for_function("() => Number(document.querySelector('#planner-chart svg')?.getAttribute('data-points')) > 0")
    page.shot("planner-panel.png")
    assert not page.errors, page.errors


def test_desired_split_differs_and_the_panel_hides_without_a_planner(serve_page: tuple[Page, dict]) -> None:
    page, doc = serve_page
    p = page.page
    view = planner_view()
    view["desired"] = {"prefill": 1, "decode": 3}
    doc["live"] = live_document(view)
    p.goto(f"{ORIGIN}/dashboard")
    p.wait_for_selector('[data-field="planner_desired"].differs')
    assert p.locator('[data-field="planner_desired"]').inner_text() == "1P3D"
    doc["live"] = live_document(None)  # --planner off, or co-located: the next poll hides it
    p.wait_for_selector("#planner-panel", state="hidden", timeout=5_000)
    assert not page.errors, page.errors


def test_the_panel_does_not_scroll_sideways_on_a_phone(browser: object) -> None:
    page = open_page(browser, NARROW, {"live": live_document(planner_view())})
    try:
        page.page.goto(f"{ORIGIN}/dashboard")
        page.page.wait_for_selector("#planner-table tbody tr[data-action]")
        page.no_horizontal_scroll()  # the long reason wraps; the table scrolls inside its own box
        page.shot("planner-panel-narrow.png")
        assert not page.errors, page.errors
    finally:
        page.close()
