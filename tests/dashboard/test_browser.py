"""The dashboard in a real browser: Playwright driving headless Chromium (Debian's `chromium`,
installed by `make test` through deploy/install_browser.sh) against `halfmoon serve` running a
1P1D cluster (real Ray workers) under a small open-loop load, auth on.

Screenshots go to test-artifacts/dashboard/ (HALFMOON_TEST_ARTIFACTS overrides); with
HALFMOON_UPDATE_DOCS_FIGURES=1 the live and sizing ones also replace docs/figures/dashboard-*.png.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import yaml

from halfmoon.conductor.serve_defaults import EXACT_FLAGS
from tests.dashboard.browser_support import NARROW, TOKEN, WIDE, Page
from tests.deploy.values import drop_nulls, merge
from tests.e2e.support import cost_model_file, wait_for_log

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "halfmoon"
UPDATE_DOCS = os.environ.get("HALFMOON_UPDATE_DOCS_FIGURES") == "1"
PROMPTS = ["The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "List three colours:", "Once upon a time"]


ADAPTER = "tuned"  # a LoRA adapter the cluster serves: every third request of the load names it


def smollm2_adapter(folder: Path) -> Path:
    """A random rank-8 LoRA adapter of SmolLM2's shapes, in PEFT's files."""
    from halfmoon.bench.lora_bench import write_adapter
    from halfmoon.engine.gguf_header import read_header
    from halfmoon.engine.loader import gguf_config, resolve_model_path
    from halfmoon.engine.lora import lora_shapes

    path = resolve_model_path("smollm2")
    return write_adapter(folder, lora_shapes(gguf_config(read_header(path), path)), rank=8, seed=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`halfmoon serve` (1 prefill + 1 decode worker, auth on, the planner advising every 3 s); yields
    its HTTP URL."""
    tmp = tmp_path_factory.mktemp("dashboard-cluster")
    log = tmp / "serve.log"
    args = [sys.executable, "-m", "halfmoon.cli.main", "serve", "--prefill", "1", "--decode", "1", "--worker-threads", "1",
            "--kv-transport", "tcp", "--grpc-port", "0", "--http-port", "0", "--num-blocks", "256",
            "--object-store-mb", "128", "--cost-model", cost_model_file(tmp / "cost.json"),
            "--lora", f"{ADAPTER}={smollm2_adapter(tmp / ADAPTER)}",
            "--planner", "advise", "--planner-interval-s", "3", "--planner-window-s", "30",
            *EXACT_FLAGS]  # the cost model's KV bytes are fp32's
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HALFMOON_API_TOKENS": TOKEN}
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, text=True, start_new_session=True, env=env)
    try:
        yield wait_for_log(proc, log, r"listening grpc=\S+ http=(\S+)").group(1)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def load(cluster: str) -> Iterator[None]:
    """A small open-loop load: one request every 1.5 s (each on its own thread, so a slow one
    does not hold the next back), at most 120, until the module is done."""
    stop = threading.Event()
    client = openai.OpenAI(base_url=cluster + "/v1", api_key=TOKEN, max_retries=0, timeout=60)

    def one(i: int) -> None:
        try:
            client.completions.create(model=ADAPTER if i % 3 == 2 else "smollm2", prompt=PROMPTS[i % len(PROMPTS)],
                                      max_tokens=12, extra_body={"ignore_eos": True})
        except openai.APIError:  # a 429 under load is the server's answer, not the test's failure
            pass

    def schedule() -> None:
        for i in range(120):
            threading.Thread(target=one, args=(i,), daemon=True).start()
            if stop.wait(1.5):  # the schedule's clock, not a synchronisation
                return

    sender = threading.Thread(target=schedule, name="dashboard-load", daemon=True)
    sender.start()
    yield
    stop.set()
    sender.join(10)


@pytest.fixture
def page(browser: object) -> Iterator[Page]:
    p = Page(browser, WIDE)
    yield p
    p.close()


def keep(shot: Path, name: str) -> None:
    if UPDATE_DOCS:
        shutil.copy(shot, ROOT / "docs" / "figures" / name)


def field(page: Page, worker: str, name: str) -> str:
    return page.page.locator(f'[data-worker="{worker}"] [data-field="{name}"]').first.inner_text().strip()


def number(text: str) -> float:
    cleaned = "".join(ch for ch in text if ch.isdigit() or ch in ".-")
    return float(cleaned) if cleaned not in ("", ".", "-") else 0.0


def test_without_a_token_it_is_a_401_sign_in_page(cluster: str, page: Page) -> None:
    response = page.page.goto(cluster + "/dashboard")
    assert response is not None and response.status == 401
    assert page.page.locator("form[action='/dashboard/login'] #token").is_visible()
    page.page.fill("#token", "not-the-token")
    page.page.press("#token", "Enter")
    page.page.wait_for_selector("text=invalid bearer token")
    page.shot("login.png")


def test_live_view_shows_both_workers_changing_and_the_slo_chart_has_data(cluster: str, load: None,
                                                                          page: Page) -> None:
    page.sign_in(cluster)
    p = page.page
    for worker in ("prefill-0", "decode-0"):
        assert p.locator(f'[data-worker="{worker}"]').is_visible()
    first = {w: number(field(page, w, "steps")) for w in ("prefill-0", "decode-0")}
    # The figures change as the load runs (the page polls every second).
    p.wait_for_function("""(first) => ['prefill-0', 'decode-0'].every(w => {
        const el = document.querySelector(`[data-worker="${w}"] [data-field="steps"]`);
        return el && Number(el.textContent.replace(/[^0-9.]/g, '')) > first[w];
    })""", arg=first, timeout=60_000)
    for worker in ("prefill-0", "decode-0"):
        assert number(field(page, worker, "steps")) > 0
        assert number(field(page, worker, "kv_device_free")) > 0
    p.wait_for_function("() => Number(document.querySelector('#ttft-chart svg')?.getAttribute('data-points') || 0) > 0",
                        timeout=60_000)
    assert int(p.locator("#tbt-chart svg").get_attribute("data-points") or 0) > 0
    assert int(p.locator("#rate-chart svg").get_attribute("data-points") or 0) > 0
    # the LoRA adapter's row: its requests counted, held by both workers; their cards show the slots
    p.wait_for_function(f"""() => [...document.querySelectorAll('#lora-table tbody tr')].some(tr =>
        tr.cells[0].textContent === '{ADAPTER}' && Number(tr.cells[2].textContent) > 0
        && tr.cells[3].textContent.includes('prefill-0') && tr.cells[3].textContent.includes('decode-0'))""",
                        timeout=60_000)
    assert p.locator("#lora-panel").is_visible()
    for worker in ("prefill-0", "decode-0"):
        assert "% hits" in field(page, worker, "lora")
    # the planner (advise, a decision every 3 s): its timeline has rows, its step plot has points
    p.wait_for_selector("#planner-table tbody tr[data-action]", timeout=60_000)
    assert p.locator("#planner-panel").is_visible()
    assert p.locator('#planner-panel [data-field="planner_mode"]').inner_text().startswith("advise")
    assert p.locator('#planner-panel [data-field="planner_split"]').inner_text() == "1P1D"
    assert int(p.locator("#planner-chart svg").get_attribute("data-points") or 0) > 0
    page.no_horizontal_scroll()
    keep(page.shot("live.png"), "dashboard-live.png")
    assert not page.errors, page.errors


def test_narrow_screen_keyboard_and_contrast(cluster: str, load: None, browser: object) -> None:
    page = Page(browser, NARROW)
    try:
        page.sign_in(cluster)
        p = page.page
        p.wait_for_function("() => Number(document.querySelector('#ttft-chart svg')?.getAttribute('data-points') || 0) > 0",
                            timeout=60_000)
        p.wait_for_selector("#planner-table tbody tr[data-action]", timeout=60_000)
        page.no_horizontal_scroll()  # the timeline's long reasons wrap; its table scrolls in its own box
        page.shot("live-narrow.png")
        # Keyboard: Tab reaches the Sizing link, Enter opens it.
        reached = []
        for _ in range(12):
            p.keyboard.press("Tab")
            reached.append(p.evaluate("document.activeElement.getAttribute('href') || document.activeElement.id"))
            if reached[-1] == "#sizing":
                break
        assert "#sizing" in reached, f"Tab never reached the Sizing link: {reached}"
        assert p.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
        p.keyboard.press("Enter")
        p.wait_for_selector("#sizing-form", state="visible")
        page.no_horizontal_scroll()
        low = p.evaluate(CONTRAST_JS)
        assert not low, f"text below WCAG AA contrast: {low[:5]}"
        assert not page.errors, page.errors
    finally:
        page.close()


def test_sizing_sweep_ends_in_a_recommendation_and_helm_values_the_chart_accepts(cluster: str, page: Page) -> None:
    page.sign_in(cluster)
    p = page.page
    p.click("a[href='#sizing']")
    p.wait_for_selector("#sizing-form select[name='trace'] option[value='sample']", state="attached")
    p.select_option("#sizing-form select[name='trace']", "sample")
    p.select_option("#sizing-form select[name='profile']", "llama3-8b-a100")
    p.fill("#sizing-form [name='workers']", "3")
    p.fill("#sizing-form [name='device_tokens']", "16384,65536")
    p.fill("#sizing-form [name='host_tokens']", "0")
    p.fill("#sizing-form [name='ttft_ms']", "5000")
    p.fill("#sizing-form [name='tbt_ms']", "300")
    p.fill("#sizing-form [name='speed']", "4")
    p.click("#sizing-form button[type='submit']")
    p.wait_for_selector("#sweep-progress", state="attached")
    p.wait_for_function("() => (document.querySelector('#recommendation')?.textContent || '').includes('Recommended')",
                        timeout=120_000)
    assert p.locator("#sweep-table tbody tr").count() == 4
    assert p.locator("#sweep-table tr.best").count() == 1
    assert int(p.locator("#sweep-chart svg").get_attribute("data-points") or 0) == 4
    snippet = yaml.safe_load(p.locator("#helm-values").inner_text())
    assert snippet["prefill"]["replicas"] + snippet["decode"]["replicas"] == 3
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = merge(yaml.safe_load((CHART / "values.yaml").read_text()), snippet)
    jsonschema.Draft7Validator(schema).validate(drop_nulls(values))
    href = p.locator("#download-values").get_attribute("href") or ""
    assert href.endswith("/values.yaml")
    page.no_horizontal_scroll()
    keep(page.shot("sizing.png"), "dashboard-sizing.png")
    assert not page.errors, page.errors


# Every element with its own visible text: its colour against the first opaque background up
# its ancestors, by WCAG 2.x relative luminance; 4.5:1 for normal text, 3:1 for large.
CONTRAST_JS = """() => {
  const parse = c => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = el => {
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c.length >= 3 && (c.length < 4 || c[3] > 0.9)) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  const low = [];
  for (const el of document.querySelectorAll('body *')) {
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    const style = getComputedStyle(el);
    if (!own || el.offsetParent === null || style.visibility === 'hidden') continue;
    const fg = parse(style.color).slice(0, 3), bg = background(el);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    const ratio = (a + 0.05) / (b + 0.05);
    const large = parseFloat(style.fontSize) >= 24 || (parseFloat(style.fontSize) >= 18.66 && Number(style.fontWeight) >= 700);
    if (ratio < (large ? 3 : 4.5)) low.push(`${el.tagName}.${el.className}: ${ratio.toFixed(2)} "${el.textContent.trim().slice(0, 30)}"`);
  }
  return low;
}"""
