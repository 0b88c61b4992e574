"""The chart's planner values (helm/halfmoon, `planner.*`): the flags reach the Conductor (checked
with every other flag in test_helm_chart.py) and `planner.autoscaler` renders one KEDA
ScaledObject per worker StatefulSet whose query reads the planner's desired workers."""

from __future__ import annotations

import re

import helm_python as helm  # helm-python-sdk: the [test] extra
import pytest

from tests.deploy.chart import CHART, FULLNAME, KUBE_VERSION, NAMESPACE, Renderer

ACT = {"mode": "act", "autoscaler": {"enabled": True}}


def test_no_scaled_object_unless_asked(renderer: Renderer) -> None:
    assert renderer.release("default").kind("ScaledObject") == []
    assert renderer.release_with({"planner": {"mode": "act"}}).kind("ScaledObject") == []


def test_the_autoscaler_sizes_each_group_to_the_planners_desired_workers(renderer: Renderer) -> None:
    values = {"planner": {**ACT, "minDecode": 2, "maxDecode": 5, "maxWorkers": 8},
              "prefill": {"replicas": 2}, "decode": {"replicas": 3}, "conductor": {"standby": 1}}
    rel = renderer.release_with(values)
    objects = {o["metadata"]["name"]: o["spec"] for o in rel.kind("ScaledObject")}
    assert set(objects) == {f"{FULLNAME}-prefill", f"{FULLNAME}-decode"}
    for role in ("prefill", "decode"):
        spec = objects[f"{FULLNAME}-{role}"]
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("StatefulSet", f"{FULLNAME}-{role}")
        rel.get("StatefulSet", target["name"])  # the group it scales exists
        (trigger,) = spec["triggers"]
        assert (trigger["type"], trigger["metricType"], trigger["metadata"]["threshold"]) == \
            ("prometheus", "AverageValue", "1")  # replicas = the query's value
        query = trigger["metadata"]["query"]
        assert f'halfmoon_planner_desired_workers{{role="{role}",namespace="{NAMESPACE}",service="{FULLNAME}"}}' \
            in query
        replicas = values[role]["replicas"]
        assert query.endswith(f"or vector({replicas})) + 1"), query  # no series yet: keep the replicas; + standby
    # bounds (+ 1 standby): never below the replicas it started with (a flipped actor stays on its
    # pod); at most the pool's own bound, else the total's less the other pool's least
    assert (objects[f"{FULLNAME}-decode"]["minReplicaCount"], objects[f"{FULLNAME}-decode"]["maxReplicaCount"]) == (4, 6)
    assert (objects[f"{FULLNAME}-prefill"]["minReplicaCount"], objects[f"{FULLNAME}-prefill"]["maxReplicaCount"]) == (3, 7)


def test_the_autoscaler_takes_custom_matchers_and_prometheus(renderer: Renderer) -> None:
    values = {"planner": {**ACT, "autoscaler": {"enabled": True, "matchers": 'job="halfmoon"',
                                                "serverAddress": "http://prom:9090", "pollingInterval": 10}}}
    (spec, _) = [o["spec"] for o in renderer.release_with(values).kind("ScaledObject")]
    meta = spec["triggers"][0]["metadata"]
    assert meta["serverAddress"] == "http://prom:9090" and spec["pollingInterval"] == 10
    assert re.search(r'halfmoon_planner_desired_workers\{role="\w+",job="halfmoon"\}', meta["query"])


@pytest.mark.parametrize("values, message", [
    ({"planner": {"autoscaler": {"enabled": True}}}, "only planner.mode act places actors on; planner.mode is advise"),
    ({"planner": ACT, "kuberay": {"enabled": True}}, "with kuberay.enabled the groups are a RayCluster's"),
])
def test_the_autoscaler_without_act_or_with_kuberay_fails_with_a_message(renderer: Renderer, values: dict,
                                                                          message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        renderer.render(values)


def test_lint_strict_passes_with_the_autoscaler() -> None:
    values = {"planner": {**ACT, "maxWorkers": 6}, "metrics": {"serviceMonitor": {"enabled": True}}}
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
