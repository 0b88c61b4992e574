"""The Grafana dashboard shipped with the chart (helm/halfmoon/dashboards/halfmoon.json).

- it is a dashboard Grafana loads: the top-level keys, the `${datasource}` variable, unique panel
  ids on a grid without overlaps, every panel querying that datasource with non-empty PromQL;
- every metric its PromQL names is one the Conductor exports: a real front door (gRPC + HTTP, in
  this process) over a scripted backend whose stats fill every family, one request through it,
  then its `/metrics` scraped and parsed; label matchers, `by (...)` labels and legends name
  labels those series carry; every exported family is on the board;
- the chart renders it as a ConfigMap for Grafana's dashboard sidecar only when
  `metrics.grafanaDashboard.enabled`, and values.schema.json takes the new values (and nothing else).
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass

import helm_python as helm  # helm-python-sdk, kubernetes-validate: the [test] extra
import httpx
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from halfmoon.conductor.admission_stats import AdmissionStats
from halfmoon.conductor.backend import BackendStats, WorkerView
from halfmoon.core.messages import WorkerLoad
from halfmoon.api.server import ServerConfig
from halfmoon.results import ModelInfo
from tests.conductor.conftest import RunningApi, ScriptedBackend, run_api
from tests.deploy.chart import CHART, FULLNAME, KUBE_VERSION, NAMESPACE, ROOT, Renderer
from tests.deploy.values import drop_nulls, merge

DASHBOARD = CHART / "dashboards" / "halfmoon.json"
CONFIGMAP = f"{FULLNAME}-grafana-dashboard"
ON = {"metrics": {"grafanaDashboard": {"enabled": True}}}
# Labels Prometheus adds to every scraped series (the target's), not the Conductor's own.
SCRAPE_LABELS = {"job", "instance"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
AGGREGATIONS = r"\b(sum|max|min|avg|count)\b\s*(by\s*\([^)]*\)\s*)?\("
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "heatmap", "table"}
# Families the Conductor exports that the board leaves out on purpose (family -> why).
NOT_ON_THE_BOARD: dict[str, str] = {}


# ---------------------------------------------------------------------------- the dashboard


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict) -> Iterator[dict]:
    """Every panel, the ones inside collapsed rows too."""
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def query_panels(board: dict) -> list[dict]:
    return [p for p in all_panels(board) if p["type"] != "row"]


def exprs(board: dict) -> Iterator[tuple[str, dict, str]]:
    """(panel title, target, expr) of every query target."""
    for panel in query_panels(board):
        for target in panel["targets"]:
            yield panel["title"], target, target["expr"]


def variable_queries(board: dict) -> list[str]:
    return [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]


def test_dashboard_has_grafanas_top_level_keys(dashboard: dict) -> None:
    required = {"title", "uid", "schemaVersion", "panels", "templating", "time", "refresh", "tags",
                "editable", "annotations", "timezone"}
    assert required <= set(dashboard)
    assert dashboard["uid"] == "halfmoon" and dashboard["title"] == "Halfmoon"
    assert 36 <= dashboard["schemaVersion"] <= 41  # Grafana 9.3 .. 11.x
    assert dashboard["time"] == {"from": "now-15m", "to": "now"}
    assert dashboard["refresh"] == "10s"
    assert "id" not in dashboard  # an id is Grafana's own, per instance; import by uid


def test_the_datasource_is_a_prometheus_variable(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert len(variables) == len(dashboard["templating"]["list"]), "variable names repeat"
    ds = variables["datasource"]
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus")
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, v["name"]


def test_panels_have_unique_ids_and_do_not_overlap(dashboard: dict) -> None:
    panels = list(all_panels(dashboard))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids)
    taken: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        assert p["type"] in PANEL_TYPES, p["title"]
        g = p["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in taken, f"{p['title']!r} overlaps {taken[(x, y)]!r}"
                taken[(x, y)] = p["title"]


def test_every_panel_queries_the_datasource_variable(dashboard: dict) -> None:
    panels = query_panels(dashboard)
    assert len(panels) >= 20
    for p in panels:
        assert p["title"] and p.get("description"), p["id"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
            assert t.get("datasource", p["datasource"]) == p["datasource"], p["title"]
        assert any("halfmoon_" in t["expr"] for t in p["targets"]), f"{p['title']} queries no halfmoon metric"


def test_promql_is_balanced_and_uses_only_defined_variables(dashboard: dict) -> None:
    defined = {v["name"] for v in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    for title, _, expr in exprs(dashboard):
        depth = {"(": 0, "{": 0, "[": 0}
        closing = {")": "(", "}": "{", "]": "["}
        for ch in expr:
            if ch in depth:
                depth[ch] += 1
            elif ch in closing:
                depth[closing[ch]] -= 1
                assert depth[closing[ch]] >= 0, f"{title}: {expr}"
        assert not any(depth.values()), f"{title}: unbalanced {expr}"
        used = {a or b for a, b in re.findall(r"\$(?:\{(\w+)[^}]*\}|(\w+))", expr)}
        assert used <= defined, f"{title}: undefined variables {used - defined} in {expr}"
        if "histogram_quantile" in expr:
            assert "_bucket" in expr and re.search(r"by\s*\([^)]*\ble\b", expr), f"{title}: {expr}"


def test_the_admission_and_worker_panels_are_there(dashboard: dict) -> None:
    """What an operator of a disaggregated cluster watches (issue 21's live page) has a panel."""
    text = " ".join(e for _, _, e in exprs(dashboard))
    for metric in ("halfmoon_requests_total", "halfmoon_time_to_first_token_seconds_bucket",
                   "halfmoon_time_per_output_token_seconds_bucket", "halfmoon_request_duration_seconds_bucket",
                   "halfmoon_admission_decisions_total", "halfmoon_queue_depth", "halfmoon_kv_cache_blocks_free",
                   "halfmoon_cached_prompt_tokens_total", "halfmoon_prediction_error_ttft_seconds_bucket",
                   "halfmoon_index_heartbeat_max_gap_seconds", "halfmoon_requests_rerun_total"):
        assert metric in text, metric
    assert re.search(r'halfmoon_admission_decisions_total\{[^}]*outcome="rejected"[^}]*\}', text)
    assert "sum by (class, reason)" in text


# ---------------------------------------------------------------------------- what /metrics exports


class FullStatsBackend(ScriptedBackend):
    """The scripted backend (tests/conductor/conftest.py), its stats as a 1P1D cluster's with
    admission, re-runs and index holders: every family of api/metrics.py has series."""

    def stats(self) -> BackendStats:
        admission = AdmissionStats()
        admission.admitted("standard")
        admission.rejected("batch", "shed")
        admission.measured(120.0, 0.1, 30.0, 0.04)
        loads = {"prefill-0": WorkerLoad(True, 10, 100, 128, 1, 500, 200, 3, host_blocks_used=5, host_blocks_total=64,
                                          blocks_from_host=2, running=1),
                 "decode-0": WorkerLoad(True, 40, 90, 128, 1, reserved_blocks=4, kv_bytes_received=1 << 20, running=1)}
        workers = tuple(WorkerView(wid, wid.split("-")[0], True, 0, 1, load, 0.0) for wid, load in loads.items())
        return BackendStats(1, 0, 90, 128, 0, {"worker_lost": 1}, {"prefill-0": 1, "decode-0": 1}, admission,
                            {"prefill-0": (2.5, 0), "decode-0": (2.6, 1), "conductor": (2.5, 0)},
                            workers=workers, index_up=True, index_errors=3)


@dataclass(frozen=True)
class Exported:
    """The scrape: sample name -> the labels its series carry; family name -> type."""

    samples: dict[str, set[str]]
    families: dict[str, str]


@pytest.fixture(scope="module")
def exported() -> Iterator[Exported]:
    model = ModelInfo("m", max_model_len=128, vocab_size=100)
    running: RunningApi = run_api(FullStatsBackend(model, None, 64), ServerConfig(grpc_port=0, http_port=0))
    try:
        # One request (prompt as token ids: the scripted backend has no tokenizer), one refusal.
        body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(running.http_url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(running.http_url + "/v1/completions", json={**body, "model": "x"},
                          timeout=30).status_code == 404
        text = httpx.get(running.http_url + "/metrics", timeout=30).text
    finally:
        running.stop()
    samples: dict[str, set[str]] = {}
    families: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for s in family.samples:
            samples.setdefault(s.name, set()).update(s.labels)
    return Exported(samples, families)


def family_of(sample: str, families: dict[str, str]) -> str | None:
    for suffix in ("_bucket", "_count", "_sum", "_total", ""):
        base = sample.removesuffix(suffix) if suffix else sample
        if (suffix == "" or sample.endswith(suffix)) and base in families:
            return base
    return None


def metrics_in(expr: str) -> list[str]:
    return re.findall(r"\bhalfmoon_[a-z0-9_]+\b", expr)


def test_the_scrape_covers_every_family_of_the_conductor(exported: Exported) -> None:
    """The fixture means something: every family api/metrics.py defines has series."""
    assert {"halfmoon_requests", "halfmoon_admission_decisions", "halfmoon_queue_depth",
            "halfmoon_index_resyncs", "halfmoon_prediction_error_tbt_seconds"} <= set(exported.families)
    for name in exported.families:
        assert any(family_of(s, exported.families) == name for s in exported.samples), f"{name}: no series"


def test_every_metric_on_the_board_is_exported(dashboard: dict, exported: Exported) -> None:
    queries = [(t, e) for t, _, e in exprs(dashboard)] + [("variable", q) for q in variable_queries(dashboard)]
    missing = [(title, name) for title, expr in queries for name in metrics_in(expr)
               if name not in exported.samples]
    assert not missing, f"series the Conductor does not export (exported: {sorted(exported.samples)}): {missing}"
    for title, expr in queries:
        for name in metrics_in(expr):
            family = family_of(name, exported.families)
            assert family is not None, f"{title}: {name}"
            if exported.families[family] == "histogram":
                assert name != family, f"{title}: a histogram is queried by _bucket/_count/_sum, not {name}"


def test_labels_in_the_promql_are_the_series_labels(dashboard: dict, exported: Exported) -> None:
    for title, target, expr in exprs(dashboard):
        carried = set().union(*(exported.samples[m] for m in metrics_in(expr))) | SCRAPE_LABELS
        for name, matchers in re.findall(r"\b(halfmoon_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers):
                assert label in exported.samples[name] | SCRAPE_LABELS, f"{title}: {name} has no label {label}"
        grouped = [set(re.findall(r"\w+", by)) for by in re.findall(r"\bby\s*\(([^)]*)\)", expr)]
        for labels in grouped:
            assert labels <= carried, f"{title}: by {labels - carried} in {expr}"
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        if re.search(AGGREGATIONS, expr):  # what survives the aggregations: every by() keeps it
            kept = set.intersection(*grouped) - {"le"} if grouped else set()
            if len(grouped) < len(re.findall(AGGREGATIONS, expr)):
                kept = set()
        else:
            kept = carried
        assert legend <= kept, f"{title}: legend {legend - kept} is not a label of {expr}"


def test_every_exported_family_is_on_the_board(dashboard: dict, exported: Exported) -> None:
    """A metric added to the Conductor gets a panel (or a reason in NOT_ON_THE_BOARD)."""
    shown = {family_of(m, exported.families) for _, _, e in exprs(dashboard) for m in metrics_in(e)}
    absent = set(exported.families) - shown - set(NOT_ON_THE_BOARD)
    assert not absent, f"exported, not on {DASHBOARD.name}: {sorted(absent)}"


# ---------------------------------------------------------------------------- the chart


def dashboard_maps(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap"
            and d["metadata"].get("labels", {}).get("grafana_dashboard") is not None]


def test_no_dashboard_configmap_by_default(renderer: Renderer) -> None:
    for variant in ("default", "gpu-1p1d"):
        assert dashboard_maps(renderer.release(variant).docs) == []
    assert renderer.release("default").values["metrics"]["grafanaDashboard"]["enabled"] is False


def test_the_dashboard_configmap_when_enabled(renderer: Renderer) -> None:
    rel = renderer.release_with(ON)
    (cm,) = dashboard_maps(rel.docs)
    meta = cm["metadata"]
    assert (meta["name"], meta["namespace"]) == (CONFIGMAP, NAMESPACE)
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["labels"]["app.kubernetes.io/part-of"] == "halfmoon" and "annotations" not in meta
    assert list(cm["data"]) == ["halfmoon.json"]
    assert cm["data"]["halfmoon.json"] == DASHBOARD.read_text().rstrip("\n")  # the file, byte for byte
    # kubectl apply keeps the object in a 256 KiB annotation; a ConfigMap holds at most 1 MiB.
    assert len(json.dumps(cm)) < 256 * 1024
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)


def test_the_dashboard_configmaps_namespace_labels_and_annotations(renderer: Renderer) -> None:
    values = {"metrics": {"grafanaDashboard": {
        "enabled": True, "namespace": "monitoring", "labels": {"grafana_dashboard": "halfmoon", "team": "ml"},
        "annotations": {"grafana_folder": "Halfmoon"}}}}
    files = renderer.render(values)
    (cm,) = dashboard_maps([d for path, text in files.items() if path.endswith(".yaml")
                            for d in yaml.safe_load_all(text) if d])
    meta = cm["metadata"]
    assert meta["namespace"] == "monitoring"
    assert (meta["labels"]["grafana_dashboard"], meta["labels"]["team"]) == ("halfmoon", "ml")  # theirs win
    assert meta["annotations"] == {"grafana_folder": "Halfmoon"}
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)


def test_the_operations_guide_dashboard_values_render(renderer: Renderer) -> None:
    """docs/OPERATIONS.md's Grafana example renders the ConfigMap where it says."""
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", guide, re.DOTALL)
    values = next(yaml.safe_load(textwrap.dedent(b)) for b in blocks if "grafanaDashboard:" in b)
    rel = renderer.release_with(values)
    (cm,) = dashboard_maps(rel.docs)
    assert cm["metadata"]["namespace"] == values["metrics"]["grafanaDashboard"]["namespace"]
    assert rel.kind("ServiceMonitor"), "the dashboard needs a scrape: the example turns it on"


def test_lint_strict_passes_with_the_dashboard_on() -> None:
    report = helm.lint(str(CHART), ON, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_schema_takes_the_dashboard_values() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    full = {"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring",
                                             "labels": {"a": "b"}, "annotations": {"grafana_folder": "x"}}}}
    jsonschema.Draft7Validator(schema).validate(drop_nulls(merge(defaults, full)))


@pytest.mark.parametrize(("values", "where"), [
    ({"folder": "x"}, "additional properties 'folder'"),
    ({"enabled": "yes"}, "/metrics/grafanaDashboard/enabled"),
    ({"namespace": "Not_A_Namespace"}, "/metrics/grafanaDashboard/namespace"),
    ({"labels": {"a": 1}}, "/metrics/grafanaDashboard/labels/a"),
])
def test_the_schema_rejects_bad_dashboard_values(renderer: Renderer, values: dict, where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        renderer.render({"metrics": {"grafanaDashboard": values}})
