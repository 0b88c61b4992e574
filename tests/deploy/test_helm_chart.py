"""The Helm chart (helm/halfmoon), checked offline: no cluster, no network, no helm binary.

- render: Helm 4's engine through `helm-python-sdk`, for the default values and every profile;
- `helm lint --strict` for Kubernetes 1.30;
- every rendered manifest against Kubernetes 1.30's schemas with `kubernetes-validate --strict`
  (unknown fields are errors), except the CRD kinds (ServiceMonitor, RayCluster), for which
  kubernetes-validate has no schema: those are asserted on directly below;
- what the manifests must say: ports = `halfmoon serve`'s, every flag of the Conductor's command
  is a real `halfmoon serve` option, Ray resources and GPUs per worker group, secrets only
  referenced, the NetworkPolicy, gRPC health probes, PDBs, ServiceMonitor, KubeRay;
- values.schema.json rejects bad values (the render and the lint fail, naming the value).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import textwrap
from collections.abc import Iterator
from typing import Any, NamedTuple

import helm_python as helm  # helm-python-sdk, kubernetes-validate, yamllint: the [test] extra
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter as yamllint_linter

from halfmoon.cli.main import build_parser
from tests.deploy.chart import (CHART, FULLNAME, KUBE_VERSION, NAMESPACE, PROFILES, RELEASE, ROOT,
                                VARIANTS, Release, Renderer, user_values)
from tests.deploy.values import drop_nulls, merge

# CRD kinds: kubernetes-validate ships only the built-in API's schemas, so these are skipped
# there (explicitly, by this list) and asserted on by the tests of this file instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("ray.io/v1", "RayCluster"),
             ("keda.sh/v1alpha1", "ScaledObject")}
GPU_VARIANTS = {"gpu-1p1d", "gpu-4p4d-external-redis", "gpu-1p1d+kuberay"}
ROLES = ("prefill", "decode")


def serve_parser() -> argparse.ArgumentParser:
    """`halfmoon serve`'s own argparse parser (the one the CLI runs)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# ---------------------------------------------------------------------------- pod helpers


def head_pod(rel: Release) -> dict:
    """The head's pod spec: the Deployment's, or the RayCluster's headGroupSpec."""
    if rel.values["kuberay"]["enabled"]:
        return rel.get("RayCluster", FULLNAME)["spec"]["headGroupSpec"]["template"]["spec"]
    return rel.get("Deployment", f"{FULLNAME}-head")["spec"]["template"]["spec"]


def worker_template(rel: Release, role: str) -> dict:
    """A worker group's pod template (metadata + spec)."""
    if rel.values["kuberay"]["enabled"]:
        groups = rel.get("RayCluster", FULLNAME)["spec"]["workerGroupSpecs"]
        return next(g for g in groups if g["groupName"] == role)["template"]
    return rel.get("StatefulSet", f"{FULLNAME}-{role}")["spec"]["template"]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def head_container(rel: Release) -> dict:
    return container(head_pod(rel), "ray-head")


def worker_container(rel: Release, role: str) -> dict:
    return container(worker_template(rel, role)["spec"], "ray-worker")


def pod_templates(rel: Release) -> Iterator[tuple[str, dict]]:
    """(component, pod template metadata) of every pod the release runs."""
    for doc in rel.docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            meta = doc["spec"]["template"]["metadata"]
            yield meta["labels"]["app.kubernetes.io/component"], meta
        elif doc["kind"] == "RayCluster":
            yield "head", doc["spec"]["headGroupSpec"]["template"]["metadata"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield group["groupName"], group["template"]["metadata"]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"selector with expressions: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def env_refs(ctr: dict) -> dict[str, dict]:
    return {e["name"]: e for e in ctr.get("env", [])}


def serve_defaults() -> argparse.Namespace:
    return build_parser().parse_args(["serve"])


def parse_serve(args: list[str]) -> argparse.Namespace:
    """The Conductor's args through the real parser; every --flag must be spelled out in full
    (argparse would accept an abbreviation, the chart must not rely on one)."""
    parser = serve_parser()
    options = {s for action in parser._actions for s in action.option_strings}
    unknown = [a for a in args if a.startswith("--") and a.split("=")[0] not in options]
    assert not unknown, f"not `halfmoon serve` options: {unknown}"
    try:
        return parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"`halfmoon serve` rejects the chart's arguments {args}: exit {e.code}")


# ---------------------------------------------------------------------------- render, lint, validate


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_strict_has_no_error_or_warning(variant: str) -> None:
    report = helm.lint(str(CHART), user_values(variant), strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    # Severity 1 is INFO (e.g. "icon is recommended"); --strict fails on warnings (2) and errors (3).
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_manifest_passes_kubernetes_validate_strict(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    crds, validated = [], []
    for doc in rel.docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            crds.append(doc["kind"])  # no schema in kubernetes-validate: asserted on elsewhere
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: {e.message}")
        validated.append(doc["kind"])
    assert {"Service", "NetworkPolicy", "PodDisruptionBudget", "ServiceAccount"} <= set(validated)
    if rel.values["kuberay"]["enabled"]:
        assert "RayCluster" in crds and "Deployment" not in validated
    else:
        assert {"Deployment", "StatefulSet"} <= set(validated)


def test_kubernetes_validate_really_is_strict(renderer: Renderer) -> None:
    """The check above means something: a misspelt field fails it."""
    deployment = dict(renderer.release("default").get("Deployment", f"{FULLNAME}-head"))
    spec = dict(deployment["spec"], replica=1)  # not a field: `replicas`
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dict(deployment, spec=spec), KUBE_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_yaml_has_no_duplicate_keys(renderer: Renderer, variant: str) -> None:
    """A duplicated key silently keeps the last value in most parsers: yamllint catches it."""
    config = yamllint_config.YamlLintConfig(
        "{extends: relaxed, rules: {line-length: disable, key-duplicates: enable, "
        "trailing-spaces: enable, empty-lines: disable, indentation: disable}}")
    for path, text in renderer.render(user_values(variant)).items():
        if path.endswith(".yaml"):
            problems = [p for p in yamllint_linter.run(text, config) if p.level == "error"]
            assert problems == [], f"{path}: {problems}"


def test_values_and_profiles_pass_yamllint() -> None:
    config = yamllint_config.YamlLintConfig(
        "{extends: default, rules: {line-length: {max: 110}, document-start: disable, "
        "comments: {min-spaces-from-content: 1}}}")
    files = [CHART / "values.yaml", CHART / "Chart.yaml", *sorted(PROFILES.glob("*.yaml"))]
    for path in files:
        problems = list(yamllint_linter.run(path.read_text(), config))
        assert problems == [], f"{path}: {problems}"


def test_every_value_is_documented() -> None:
    """Every leaf of values.yaml has a comment right above it or above one of its parents."""
    entries = []  # (indent, key, has an inline value, comment right above)
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z0-9_]+):(.*)$", line)
        if match:
            inline = match.group(3).split(" #")[0].strip()
            entries.append((len(match.group(1)), match.group(2), bool(inline),
                            previous.lstrip().startswith("#")))
        if line.strip():
            previous = line
    ancestors: list[tuple[int, bool]] = []
    undocumented = []
    for i, (indent, key, inline, commented) in enumerate(entries):
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        leaf = inline or i + 1 == len(entries) or entries[i + 1][0] <= indent
        if leaf and not (commented or any(doc for _, doc in ancestors)):
            undocumented.append(key)
        ancestors.append((indent, commented))
    assert len(entries) > 50 and undocumented == []


# ---------------------------------------------------------------------------- the Conductor


@pytest.mark.parametrize("variant", VARIANTS)
def test_ports_are_the_ones_halfmoon_serve_listens_on(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    defaults = serve_defaults()
    expected = {"grpc": defaults.grpc_port, "http": defaults.http_port}
    assert expected == {"grpc": 50051, "http": 8000}
    ports = {p["name"]: p["containerPort"] for p in head_container(rel)["ports"]}
    assert {k: ports[k] for k in expected} == expected
    front = rel.get("Service", FULLNAME)
    assert {p["name"]: p["port"] for p in front["spec"]["ports"]} == expected
    assert {p["name"]: p["targetPort"] for p in front["spec"]["ports"]} == {"grpc": "grpc", "http": "http"}
    # The ports the Conductor is told to listen on are the same numbers.
    args = parse_serve(head_container(rel)["args"])
    assert (args.grpc_port, args.http_port) == (expected["grpc"], expected["http"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_starts_ray_then_the_conductor_with_real_flags(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    v = rel.values
    head = head_container(rel)
    launcher = " ".join(head["command"])
    assert head["command"][:4] == ["tini", "--", "/bin/sh", "-c"]
    assert re.search(r"ray start --head --port=6379 .*&& exec halfmoon serve \"\$@\"$", head["command"][4])
    assert "--block" not in launcher  # `ray start` returns; the Conductor holds the container
    args = parse_serve(head["args"])
    assert args.ray_address == "auto" and not args.colocated
    assert (args.prefill, args.decode) == (v["prefill"]["replicas"], v["decode"]["replicas"])
    assert args.worker_threads == v["conductor"]["workerThreads"]
    # The Conductor asks Ray for the GPUs each group's pods carry (the head itself has none).
    assert (args.prefill_gpus, args.decode_gpus) == (v["prefill"]["gpus"], v["decode"]["gpus"])
    assert (args.host, args.kv_host, args.kv_port) == ("0.0.0.0", "0.0.0.0", v["kvTransport"]["port"])
    assert args.kv_port != 0  # a fixed port: declared on the decode pods
    assert args.redis_url.startswith(("redis://", "rediss://")) and not args.no_redis
    # Kubernetes substitutes $(VAR) only from the container's own env: each must be defined.
    env = env_refs(head)
    for var in re.findall(r"\$\(([A-Z0-9_]+)\)", " ".join(head["args"])):
        assert var in env, f"$({var}) in the Conductor's args but not in its env"
    disk = v["kvTiers"]["disk"]
    if disk["sizeGb"] > 0:
        assert (args.disk_cache_dir, args.disk_cache_gb) == (disk["mountPath"], disk["sizeGb"])
    assert args.host_cache_gb == v["kvTiers"]["hostGb"]


def test_large_and_fractional_numbers_reach_the_conductor_intact(renderer: Renderer) -> None:
    """Values arrive as JSON numbers (float64 in Go): 1048576 must not become 1.048576e+06."""
    values = {"engine": {"maxModelLen": 1048576, "maxNumBatchedTokens": 2000000, "kvCacheGb": 0.5},
              "kvTiers": {"hostGb": 1048576, "disk": {"sizeGb": 2.5, "volume": {"type": "emptyDir"}}}}
    head = next(d for d in yaml.safe_load_all(renderer.render(values)["halfmoon/templates/head.yaml"])
                if d["kind"] == "Deployment")
    args = parse_serve(head["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (args.max_model_len, args.max_num_batched_tokens, args.kv_cache_gb) == (1048576, 2000000, 0.5)
    assert (args.host_cache_gb, args.disk_cache_gb) == (1048576, 2.5)


# ---------------------------------------------------------------------------- worker groups


def ray_start_flags(rel: Release, role: str) -> dict[str, str]:
    """`ray start` flags of a worker group: the command line, or KubeRay's rayStartParams."""
    if rel.values["kuberay"]["enabled"]:
        group = next(g for g in rel.get("RayCluster", FULLNAME)["spec"]["workerGroupSpecs"]
                     if g["groupName"] == role)
        params = dict(group["rayStartParams"])
        # KubeRay's format: the JSON object inside a quoted, escaped string.
        params["resources"] = json.loads(params["resources"])
        return params
    command = worker_container(rel, role)["command"]
    assert command[:4] == ["tini", "--", "ray", "start"] and "--block" in command
    flags = dict(a[2:].split("=", 1) for a in command[4:] if "=" in a)
    return flags


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("role", ROLES)
def test_worker_group_ray_resources_and_devices(renderer: Renderer, variant: str, role: str) -> None:
    rel = renderer.release(variant)
    v, group = rel.values, rel.values[role]
    flags = ray_start_flags(rel, role)
    assert json.loads(flags["resources"]) == {role: 1}
    assert int(flags["num-cpus"]) == v["conductor"]["workerThreads"]
    if not v["kuberay"]["enabled"]:
        assert flags["address"] == f"{FULLNAME}-head.{NAMESPACE}.svc:6379"
        assert rel.get("StatefulSet", f"{FULLNAME}-{role}")["spec"]["replicas"] == group["replicas"]
    resources = worker_container(rel, role)["resources"]
    gpu = v["gpu"]["resourceName"]
    if variant in GPU_VARIANTS:
        assert group["gpus"] >= 1
        assert parse_serve(head_container(rel)["args"]).device == "cuda", "a CUDA image's workers use their GPUs"
        assert resources["requests"][gpu] == resources["limits"][gpu] == group["gpus"]
        if not v["kuberay"]["enabled"]:
            assert int(flags["num-gpus"]) == group["gpus"]
    else:
        assert gpu not in resources.get("requests", {}) and gpu not in resources.get("limits", {})
        assert "num-gpus" not in flags
        assert parse_serve(head_container(rel)["args"]).device == "cpu"
    rdma = v["rdma"]["resourceName"]
    caps = worker_container(rel, role)["securityContext"]["capabilities"]
    if group["rdmaDevices"]:
        assert resources["limits"][rdma] == group["rdmaDevices"] and caps.get("add") == ["IPC_LOCK"]
    else:
        assert rdma not in resources.get("limits", {}) and "add" not in caps
    assert variant != "gpu-4p4d-external-redis" or (group["replicas"], group["rdmaDevices"]) == (4, 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("role", ROLES)
def test_worker_group_volumes_ports_and_placement(renderer: Renderer, variant: str, role: str) -> None:
    rel = renderer.release(variant)
    v, group = rel.values, rel.values[role]
    template = worker_template(rel, role)
    pod, ctr = template["spec"], worker_container(rel, role)
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    mounts = {m["name"]: m for m in ctr["volumeMounts"]}
    # /dev/shm: a memory emptyDir holding the host tier and Ray's object store.
    assert mounts["shm"]["mountPath"] == "/dev/shm" and volumes["shm"]["emptyDir"]["medium"] == "Memory"
    shm_mi = int(volumes["shm"]["emptyDir"]["sizeLimit"].removesuffix("Mi"))
    assert shm_mi * 2**20 >= (v["kvTiers"]["hostGb"] + v["ray"]["objectStoreMemoryGb"]) * 2**30
    # The disk tier: mounted where the Conductor tells the workers (--disk-cache-dir).
    disk = v["kvTiers"]["disk"]
    if disk["sizeGb"] > 0:
        assert mounts["kv-disk"]["mountPath"] == disk["mountPath"]
        kind = disk["volume"]["type"]
        if kind == "hostPath":
            assert volumes["kv-disk"]["hostPath"]["path"] == disk["volume"]["hostPath"]
            assert mounts["kv-disk"]["subPathExpr"] == "$(POD_NAME)"  # one process owns a tier
        elif kind == "pvc":
            claims = rel.get("StatefulSet", f"{FULLNAME}-{role}")["spec"]["volumeClaimTemplates"]
            assert [c["metadata"]["name"] for c in claims] == ["kv-disk"]
        else:
            assert "emptyDir" in volumes["kv-disk"]
    else:
        assert "kv-disk" not in mounts
    # The KV transport: decode workers' receivers listen on the fixed --kv-port.
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    assert ports == ({"kv": v["kvTransport"]["port"]} if role == "decode" else {})
    # Placement straight from the values (the affinity plus placement.separateRoles' term).
    for key in ("nodeSelector", "tolerations"):
        assert pod.get(key, type(group[key])()) == group[key]
    assert pod.get("affinity", {}) == expected_affinity(group["affinity"], v["placement"]["separateRoles"], role)
    # The shared KV secret reaches the raylet (and so the actors) from a Secret reference.
    assert "secretKeyRef" in env_refs(ctr)["HALFMOON_KV_SECRET"]["valueFrom"]
    # The model is where the Conductor says it is.
    model = v["model"]
    if model["source"] != "builtin":
        assert mounts["model"]["mountPath"] == model["mountPath"] and mounts["model"]["readOnly"]
    # The dequantized weights survive a container restart in the pod's own emptyDir.
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    if model["weightsCache"]["enabled"]:
        assert env["HALFMOON_CACHE_DIR"] == mounts["weights-cache"]["mountPath"]
        assert volumes["weights-cache"]["emptyDir"]["sizeLimit"] == model["weightsCache"]["sizeLimit"]
    else:
        assert env["HALFMOON_WEIGHTS_CACHE"] == "0" and "weights-cache" not in mounts


def _anti_affinity(rel: Release, role: str) -> dict:
    return worker_template(rel, role)["spec"].get("affinity", {}).get("podAntiAffinity", {})


@pytest.mark.parametrize("kuberay", [False, True])
@pytest.mark.parametrize("role", ROLES)
def test_prefill_and_decode_pods_keep_to_separate_nodes(renderer: Renderer, kuberay: bool, role: str) -> None:
    """placement.separateRoles: the other role's pods of this release, on the same node (hostname),
    repel this group's: preferred by default (a one-node cluster still schedules), required on
    demand, off leaves only the group's own affinity."""
    other = "decode" if role == "prefill" else "prefill"
    group_affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}
    base = {"kuberay": {"enabled": kuberay}, role: {"affinity": group_affinity}}
    rel = renderer.release_with(base)
    term = _anti_affinity(rel, role)["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    labels = term["labelSelector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == other and labels["app.kubernetes.io/instance"] == RELEASE
    others = [meta["labels"] for component, meta in pod_templates(rel) if component == other] if not kuberay else []
    assert all(labels.items() <= pod.items() for pod in others)  # the term selects the other group's pods
    assert worker_template(rel, role)["spec"]["affinity"]["nodeAffinity"] == group_affinity["nodeAffinity"]
    required = renderer.release_with(merge(base, {"placement": {"separateRoles": "required"}}))
    (term,) = _anti_affinity(required, role)["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == other
    off = renderer.release_with(merge(base, {"placement": {"separateRoles": "off"}}))
    assert worker_template(off, role)["spec"]["affinity"] == group_affinity


def test_the_groups_own_anti_affinity_terms_are_kept(renderer: Renderer) -> None:
    spread = {"topologyKey": "kubernetes.io/hostname",
              "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}
    own = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [spread]}}
    for mode in ("preferred", "required"):
        rel = renderer.release_with({"decode": {"affinity": own}, "placement": {"separateRoles": mode}})
        assert worker_template(rel, "decode")["spec"]["affinity"] == expected_affinity(own, mode, "decode")


def expected_affinity(own: dict, mode: str, role: str) -> dict:
    """A worker group's `own` affinity with placement.separateRoles' term appended."""
    if mode == "off":
        return own
    other = "decode" if role == "prefill" else "prefill"
    term = {"labelSelector": {"matchLabels": {"app.kubernetes.io/name": "halfmoon", "app.kubernetes.io/instance": RELEASE,
                                              "app.kubernetes.io/component": other}},
            "topologyKey": "kubernetes.io/hostname"}
    key, entry = (("requiredDuringSchedulingIgnoredDuringExecution", term) if mode == "required" else
                  ("preferredDuringSchedulingIgnoredDuringExecution", {"weight": 100, "podAffinityTerm": term}))
    anti = dict(own.get("podAntiAffinity", {}))
    anti[key] = [*anti.get(key, []), entry]
    return {**own, "podAntiAffinity": anti}


def test_the_weights_cache_can_be_turned_off(renderer: Renderer) -> None:
    rel = renderer.release_with({"model": {"weightsCache": {"enabled": False}}})
    for role in ROLES:
        ctr = worker_container(rel, role)
        env = {e["name"]: e.get("value") for e in ctr["env"]}
        assert env["HALFMOON_WEIGHTS_CACHE"] == "0" and "HALFMOON_CACHE_DIR" not in env
        assert "weights-cache" not in {vol["name"] for vol in worker_template(rel, role)["spec"]["volumes"]}


# ---------------------------------------------------------------------------- secrets


def _strings(values: Any) -> Iterator[str]:
    if isinstance(values, dict):
        for v in values.values():
            yield from _strings(v)
    elif isinstance(values, list):
        for v in values:
            yield from _strings(v)
    elif isinstance(values, str) and values:
        yield values


@pytest.mark.parametrize("variant", VARIANTS)
def test_secrets_are_only_referenced(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    v = rel.values
    # The only Secrets the chart writes are the generated Redis password and KV secret, each
    # only when no existing Secret is named; nothing in them comes from the values.
    generated = set()
    if v["redis"]["bundled"]["enabled"] and not v["redis"]["bundled"]["existingSecret"]:
        generated.add((f"{FULLNAME}-redis", v["redis"]["bundled"]["passwordKey"]))
    if not v["kvTransport"]["secret"]["existingSecret"]:
        generated.add((f"{FULLNAME}-kv", v["kvTransport"]["secret"]["key"]))
    secrets = rel.kind("Secret")
    assert {(s["metadata"]["name"], *s["data"]) for s in secrets} == generated
    value_strings = set(_strings(v))
    for secret in secrets:
        assert secret["metadata"]["annotations"]["halfmoon.io/generated"] == "true"
        assert "stringData" not in secret
        for data in secret["data"].values():
            plain = base64.b64decode(data).decode()
            assert re.fullmatch(r"[A-Za-z0-9]{40}", plain) and plain not in value_strings
    # Every Secret a pod uses is either generated here or named in the values.
    named = {v["auth"]["existingSecret"], v["tls"]["existingSecret"], v["ray"]["auth"]["existingSecret"],
             v["kvTransport"]["secret"]["existingSecret"], v["redis"]["bundled"]["existingSecret"],
             v["redis"]["external"]["existingSecret"]} - {""}
    allowed = named | {name for name, _ in generated}
    for pod_doc in _all_pod_specs(rel):
        for ctr in pod_doc.get("initContainers", []) + pod_doc["containers"]:
            for env in ctr.get("env", []):
                if re.search(r"PASSWORD|SECRET|TOKEN", env["name"]):
                    assert "value" not in env, f"{env['name']} has a literal value"
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in allowed
            for mount in ctr.get("volumeMounts", []):
                if mount["name"] in ("api-tokens", "tls"):
                    assert mount.get("readOnly") is True
        for vol in pod_doc.get("volumes", []):
            if "secret" in vol:
                assert vol["secret"]["secretName"] in allowed
    # The Redis password reaches the URL only as a reference Kubernetes substitutes.
    args = parse_serve(head_container(rel)["args"])
    if generated or v["redis"]["external"]["existingSecret"] or v["redis"]["bundled"]["existingSecret"]:
        assert "$(HALFMOON_REDIS_PASSWORD)@" in args.redis_url


def test_schema_is_valid_draft7_and_accepts_every_profile() -> None:
    """An independent implementation (python-jsonschema) agrees with Helm's on the profiles."""
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for variant in VARIANTS:
        values = drop_nulls(merge(defaults, user_values(variant)))  # Helm drops null values too
        jsonschema.Draft7Validator(schema).validate(values)


def test_the_operations_guide_values_render_and_validate(renderer: Renderer) -> None:
    """docs/OPERATIONS.md's 3-node walkthrough uses values that render and validate."""
    guide = (ROOT / "docs" / "OPERATIONS.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", guide, re.DOTALL)
    values = next(yaml.safe_load(textwrap.dedent(b)) for b in blocks if "prefill:" in b)
    assert values["prefill"]["nodeSelector"] != values["decode"]["nodeSelector"]
    files = renderer.render(values)
    docs = [d for path, text in files.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "NetworkPolicy"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _all_pod_specs(rel: Release) -> Iterator[dict]:
    for doc in rel.docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["spec"]["template"]["spec"]
        elif doc["kind"] == "RayCluster":
            yield doc["spec"]["headGroupSpec"]["template"]["spec"]
            for group in doc["spec"]["workerGroupSpecs"]:
                yield group["template"]["spec"]


def test_generated_secrets_are_random_and_existing_ones_are_used(renderer: Renderer) -> None:
    def secret_values(values: dict) -> dict[str, str]:
        files = renderer.render(values)
        docs = [d for d in yaml.safe_load_all(files["halfmoon/templates/secrets.yaml"]) if d]
        return {d["metadata"]["name"]: next(iter(d["data"].values())) for d in docs}

    first, second = secret_values({}), secret_values({})
    assert set(first) == {f"{FULLNAME}-redis", f"{FULLNAME}-kv"}
    assert all(first[name] != second[name] for name in first)  # generated, not from the values
    named = {"redis": {"bundled": {"existingSecret": "my-redis", "passwordKey": "pw"}},
             "kvTransport": {"secret": {"existingSecret": "my-kv"}}}
    assert secret_values(named) == {}
    files = renderer.render(named)
    redis = next(d for d in yaml.safe_load_all(files["halfmoon/templates/redis.yaml"])
                 if d and d["kind"] == "StatefulSet")
    ref = redis["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "my-redis", "key": "pw"}


def test_tls_and_tokens_are_mounted_from_named_secrets(renderer: Renderer) -> None:
    rel = renderer.release("gpu-1p1d")
    head, pod = head_container(rel), head_pod(rel)
    args = parse_serve(head["args"])
    mounts = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}
    volumes = {vol["name"]: vol for vol in pod["volumes"]}
    assert volumes["api-tokens"]["secret"]["secretName"] == "halfmoon-api-tokens"
    assert volumes["tls"]["secret"]["secretName"] == "halfmoon-tls"
    assert args.api_token_file == f"{mounts['api-tokens']}/tokens"
    assert (args.tls_cert, args.tls_key) == (f"{mounts['tls']}/tls.crt", f"{mounts['tls']}/tls.key")
    default = parse_serve(head_container(renderer.release("default"))["args"])
    assert (default.api_token_file, default.tls_cert, default.tls_key) == (None, None, None)


# ---------------------------------------------------------------------------- network, probes, PDBs


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_admits_only_the_front_door_from_outside(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    defaults = serve_defaults()
    release_labels = {"app.kubernetes.io/name": "halfmoon", "app.kubernetes.io/instance": RELEASE}
    extra = rel.values["networkPolicy"]["extraIngressFrom"]
    policies = rel.kind("NetworkPolicy")
    assert policies
    open_ports = set()
    for policy in policies:
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            if "from" not in rule:  # from anywhere: only the Conductor's two ports, only the head
                assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
                open_ports |= {(p["port"], p["protocol"]) for p in rule["ports"]}
                continue
            for peer in rule["from"]:
                if peer in extra:
                    continue
                assert set(peer) == {"podSelector"}, f"a peer outside the release: {peer}"
                assert peer["podSelector"] == {"matchLabels": release_labels}
    assert open_ports == {(defaults.grpc_port, "TCP"), (defaults.http_port, "TCP")}
    # Every pod of the release is selected by some policy, so what is not admitted is denied.
    for component, meta in pod_templates(rel):
        assert any(selects(p["spec"]["podSelector"], meta["labels"]) for p in policies), component


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_probes_use_the_grpc_health_service(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    head = head_container(rel)
    defaults = serve_defaults()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if rel.values["tls"]["existingSecret"]:
            # The kubelet's gRPC probe cannot speak TLS: HTTPS GET /health (same readiness source).
            assert head[probe]["httpGet"] == {"path": "/health", "port": defaults.http_port, "scheme": "HTTPS"}
        else:
            assert head[probe]["grpc"] == {"port": defaults.grpc_port}
    # The startup probe covers workers joining, loading the model and profiling.
    startup = head["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_group_has_a_pod_disruption_budget(renderer: Renderer, variant: str) -> None:
    rel = renderer.release(variant)
    pdbs = rel.kind("PodDisruptionBudget")
    for component, meta in pod_templates(rel):
        matching = [p for p in pdbs if selects(p["spec"]["selector"], meta["labels"])]
        assert len(matching) == 1, f"{component}: {len(matching)} PDBs"
        assert matching[0]["metadata"]["name"] == f"{FULLNAME}-{component}"
    components = {c for c, _ in pod_templates(rel)}
    assert components == {"head", "prefill", "decode"} | (
        {"redis"} if rel.values["redis"]["bundled"]["enabled"] else set())


def test_service_monitor_only_when_enabled(renderer: Renderer) -> None:
    assert renderer.release("default").kind("ServiceMonitor") == []
    assert renderer.release("cpu-small").kind("ServiceMonitor") == []
    rel = renderer.release("gpu-1p1d")
    (monitor,) = rel.kind("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["scheme"]) == ("http", "/metrics", "https")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    front = rel.get("Service", FULLNAME)
    assert selects(monitor["spec"]["selector"], front["metadata"]["labels"])
    assert not selects(monitor["spec"]["selector"], rel.get("Service", f"{FULLNAME}-head")["metadata"]["labels"])


# ---------------------------------------------------------------------------- KubeRay


@pytest.mark.parametrize("profile", ["cpu-small", "gpu-1p1d"])
def test_kuberay_renders_a_raycluster_with_the_same_groups(renderer: Renderer, profile: str) -> None:
    plain, ray = renderer.release(profile), renderer.release(f"{profile}+kuberay")
    (cluster,) = ray.kind("RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert cluster["spec"]["rayVersion"] == ray.values["kuberay"]["rayVersion"]
    # No plain head or worker pods next to it (Redis stays a StatefulSet).
    assert [d["metadata"]["name"] for d in ray.kind("StatefulSet")] == [f"{FULLNAME}-redis"]
    assert ray.kind("Deployment") == []
    # The head: the same command and the same Conductor flags.
    assert head_container(ray)["command"] == head_container(plain)["command"]
    assert head_container(ray)["args"] == head_container(plain)["args"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    for role in ROLES:
        replicas = plain.values[role]["replicas"]
        assert groups[role]["replicas"] == groups[role]["minReplicas"] == groups[role]["maxReplicas"] == replicas
        assert json.loads(json.loads(groups[role]["rayStartParams"]["resources"])) == {role: 1}
        assert worker_container(ray, role)["resources"] == worker_container(plain, role)["resources"]
        assert "$KUBERAY_GEN_RAY_START_CMD" in worker_container(ray, role)["args"][0]
        labels = worker_template(ray, role)["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == role


def test_both_groups_on_one_ray_resource_fails_with_a_message(renderer: Renderer) -> None:
    values = {"prefill": {"rayResource": "worker"}, "decode": {"rayResource": "worker"}}
    with pytest.raises(helm.HelmRenderError, match="prefill.rayResource and decode.rayResource"):
        renderer.render(values)


def test_tensor_parallel_groups_reach_the_conductor_with_tiers_and_index(renderer: Renderer) -> None:
    """prefill.tp / decode.tp give --prefill-tp / --decode-tp; tensor-parallel workers keep the
    host and disk tiers and the block index as every worker does (their records hold every
    rank's shard: docs/ARCHITECTURE.md, "Tiers and the block index under tp")."""
    values = {"prefill": {"tp": 2, "gpus": 2}, "decode": {"tp": 4, "gpus": 4},
              "kvTiers": {"hostGb": 2, "disk": {"sizeGb": 4}}}
    head = next(d for d in yaml.safe_load_all(renderer.render(values)["halfmoon/templates/head.yaml"])
                if d["kind"] == "Deployment")
    args = parse_serve(head["spec"]["template"]["spec"]["containers"][0]["args"])
    assert (args.prefill_tp, args.decode_tp, args.prefill_gpus, args.decode_gpus) == (2, 4, 2, 4)
    assert not args.no_redis and args.redis_url is not None and args.host_cache_gb == 2
    assert args.disk_cache_dir is not None and args.disk_cache_gb == 4


@pytest.mark.parametrize("role", ROLES)
def test_a_groups_ray_resource_is_what_its_pods_advertise_and_the_conductor_asks(renderer: Renderer,
                                                                                 role: str) -> None:
    values = {"prefill": {"rayResource": "gpu-pool-a"}, "decode": {"rayResource": "gpu-pool-b"}}
    for kuberay in (False, True):
        rel = renderer.release_with(merge(values, {"kuberay": {"enabled": kuberay}}))
        name = values[role]["rayResource"]
        assert json.loads(ray_start_flags(rel, role)["resources"]) == {name: 1}
        args = head_container(rel)["args"]
        assert args[args.index(f"--{role}-resource") + 1] == name


def test_kuberay_with_a_pvc_disk_tier_fails_with_a_message(renderer: Renderer) -> None:
    values = {"kuberay": {"enabled": True}, "kvTiers": {"disk": {"sizeGb": 10, "volume": {"type": "pvc"}}}}
    with pytest.raises(helm.HelmRenderError, match="kvTiers.disk.volume.type=pvc"):
        renderer.render(values)


# ---------------------------------------------------------------------------- values.schema.json


BAD_VALUES = {
    "negative prefill replicas": ({"prefill": {"replicas": -1}}, "/prefill/replicas"),
    "negative decode replicas": ({"decode": {"replicas": -2}}, "/decode/replicas"),
    "unknown key in a worker group": ({"decode": {"gpu": 1}}, "additional properties 'gpu'"),
    "bundled Redis off, no URL": ({"redis": {"bundled": {"enabled": False}}}, "/redis/external/url"),
    "a password in the values": ({"redis": {"bundled": {"password": "x"}}}, "additional properties 'password'"),
    "a password in the Redis URL": (
        {"redis": {"bundled": {"enabled": False}, "external": {"url": "redis://:hunter2@r:6379/0"}}},
        "/redis/external/url"),
    "negative GPUs": ({"prefill": {"gpus": -1}}, "/prefill/gpus"),
    "a Ray resource name with a quote": ({"prefill": {"rayResource": 'pre"fill'}}, "/prefill/rayResource"),
    "pvc model without a claim": ({"model": {"source": "pvc", "path": "m"}}, "/model/pvc/claimName"),
    "UCX_TLS for the tcp backend": ({"kvTransport": {"backend": "tcp", "ucxTls": "rc"}}, "/kvTransport/ucxTls"),
    "negative UCX polling": ({"kvTransport": {"ucxPollUs": -1}}, "/kvTransport/ucxPollUs"),
    "unknown admission policy": ({"admission": {"policy": "lottery"}}, "/admission/policy"),
    "unknown role placement": ({"placement": {"separateRoles": "sometimes"}}, "/placement/separateRoles"),
    "negative class objective": ({"admission": {"classes": {"batch": {"tbtMs": -1}}}},
                                 "/admission/classes/batch/tbtMs"),
    "an adapter without a path": ({"lora": {"adapters": [{"name": "a"}]}}, "/lora/adapters/0"),
    "an adapter name with a space": ({"lora": {"adapters": [{"name": "a b", "path": "/a"}]}},
                                     "/lora/adapters/0/name"),
    "zero LoRA slots": ({"lora": {"maxLoras": 0}}, "/lora/maxLoras"),
    "unknown planner mode": ({"planner": {"mode": "autopilot"}}, "/planner/mode"),
    "a planner interval of zero": ({"planner": {"intervalS": 0}}, "/planner/intervalS"),
    "an empty decode pool": ({"planner": {"minDecode": 0}}, "/planner/minDecode"),
}


@pytest.mark.parametrize("case", BAD_VALUES)
def test_schema_rejects_bad_values(renderer: Renderer, case: str) -> None:
    values, where = BAD_VALUES[case]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        renderer.render(values)


@pytest.mark.parametrize("case", ["negative prefill replicas", "unknown key in a worker group",
                                  "bundled Redis off, no URL"])
def test_lint_fails_on_bad_values(case: str) -> None:
    values, where = BAD_VALUES[case]
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] and any(where in e for e in report["errors"])


def test_bundled_redis_off_with_an_url_renders(renderer: Renderer) -> None:
    values = {"redis": {"bundled": {"enabled": False}, "external": {"url": "rediss://r.example:6380/1"}}}
    files = renderer.render(values)
    assert not files["halfmoon/templates/redis.yaml"].strip()
    head = next(d for d in yaml.safe_load_all(files["halfmoon/templates/head.yaml"]) if d["kind"] == "Deployment")
    args = head["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--redis-url") + 1] == "rediss://r.example:6380/1"


@pytest.mark.parametrize("kuberay", [False, True])
def test_lora_adapters_come_from_a_read_only_volume_with_admin_tokens(renderer: Renderer, kuberay: bool) -> None:
    """lora.adapters give one --lora each (a relative path inside lora.volume's mount), the
    adapters' PVC is mounted read-only in the head (the Conductor checks them) and in every
    worker pod (each reads an adapter when a request first names it); auth.admin's Secret gives
    --admin-token-file, mounted read-only in the head only."""
    values = {"kuberay": {"enabled": kuberay}, "auth": {"admin": {"existingSecret": "hm-admin"}},
              "lora": {"adapters": [{"name": "sql-lora", "path": "sql"}, {"name": "chat", "path": "/models/chat"}],
                       "volume": {"claimName": "adapters-pvc", "mountPath": "/adapters"}, "maxRank": 32}}
    rel = renderer.release_with(values)
    head, pod = head_container(rel), head_pod(rel)
    args = parse_serve(head["args"])
    assert args.lora == ["sql-lora=/adapters/sql", "chat=/models/chat"]
    assert (args.max_lora_rank, args.max_loras, args.lora_base_check) == (32, 4, True)
    assert args.admin_token_file == "/etc/halfmoon/admin-tokens/tokens"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["admin-tokens"]["secret"]["secretName"] == "hm-admin"
    assert {"name": "admin-tokens", "mountPath": "/etc/halfmoon/admin-tokens", "readOnly": True} in head["volumeMounts"]
    mount = {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}
    for name, spec, ctr in [("head", pod, head),
                            *((role, worker_template(rel, role)["spec"], worker_container(rel, role)) for role in ROLES)]:
        claim = {v["name"]: v for v in spec["volumes"]}["lora-adapters"]["persistentVolumeClaim"]
        assert claim == {"claimName": "adapters-pvc", "readOnly": True}, name
        assert mount in ctr["volumeMounts"], name
        if name != "head":
            assert "admin-tokens" not in {v["name"] for v in spec["volumes"]}
    default = renderer.release("default")
    assert "lora-adapters" not in {v["name"] for v in head_pod(default)["volumes"]}
    assert parse_serve(head_container(default)["args"]).lora is None


def test_a_relative_adapter_path_without_a_volume_fails_with_a_message(renderer: Renderer) -> None:
    with pytest.raises(helm.HelmRenderError, match="lora.volume.claimName is empty"):
        renderer.render({"lora": {"adapters": [{"name": "a", "path": "a"}]}})


def test_notes_tell_how_to_connect(renderer: Renderer) -> None:
    notes = renderer.release("default").notes
    assert f"port-forward svc/{FULLNAME} 50051 8000" in notes and "WARNING: no API tokens" in notes
    assert "WARNING" not in renderer.release("gpu-1p1d").notes


# ---------------------------------------------------------------------------- every serve flag


class HelmValue(NamedTuple):
    """The value of the chart that sets one `halfmoon serve` flag: its dotted path in values.yaml,
    a value to render with, and the flag's argument it must give (None: a path the chart
    derives, e.g. where it mounts the named Secret)."""

    path: str
    sample: Any
    arg: str | None


# Every `halfmoon serve` option is set by a value of the chart (a new config field's flag needs
# one here, in values.yaml and in values.schema.json), or excluded with the reason.
SERVE_FLAG_VALUES: dict[str, HelmValue] = {
    "--prefill": HelmValue("prefill.replicas", 3, "3"),
    "--decode": HelmValue("decode.replicas", 2, "2"),
    "--prefill-gpus": HelmValue("prefill.gpus", 1, "1"),
    "--decode-gpus": HelmValue("decode.gpus", 1, "1"),
    "--prefill-tp": HelmValue("prefill.tp", 1, "1"),
    "--decode-tp": HelmValue("decode.tp", 1, "1"),
    "--prefill-resource": HelmValue("prefill.rayResource", "probe-prefill", "probe-prefill"),
    "--decode-resource": HelmValue("decode.rayResource", "probe-decode", "probe-decode"),
    "--no-remote-fetch": HelmValue("kvTiers.remoteFetch", False, None),
    "--worker-threads": HelmValue("conductor.workerThreads", 2, "2"),
    "--grpc-port": HelmValue("conductor.grpcPort", 50052, "50052"),
    "--http-port": HelmValue("conductor.httpPort", 8001, "8001"),
    "--served-model-name": HelmValue("conductor.servedModelName", "probe", "probe"),
    "--tool-call-parser": HelmValue("conductor.toolCallParser", "mistral", "mistral"),
    "--request-timeout-s": HelmValue("conductor.requestTimeoutS", 90, "90"),
    "--migration-attempts": HelmValue("conductor.migrationAttempts", 5, "5"),
    "--migration-stall-s": HelmValue("conductor.migrationStallS", 12.5, "12.5"),
    "--ray-wait-s": HelmValue("conductor.rayWaitS", 90, "90"),
    "--standby": HelmValue("conductor.standby", 1, "1"),
    "--prefill-max-seqs": HelmValue("engine.prefillMaxSeqs", 4, "4"),
    "--max-prompt-tokens": HelmValue("conductor.limits.maxPromptTokens", 1000, "1000"),
    "--max-tokens-limit": HelmValue("conductor.limits.maxTokens", 1001, "1001"),
    "--max-request-bytes": HelmValue("conductor.limits.maxRequestBytes", 1002, "1002"),
    "--max-streams-per-client": HelmValue("conductor.limits.maxStreamsPerClient", 1003, "1003"),
    "--max-stop": HelmValue("conductor.limits.maxStop", 1004, "1004"),
    "--max-stop-chars": HelmValue("conductor.limits.maxStopChars", 1005, "1005"),
    "--max-messages": HelmValue("conductor.limits.maxMessages", 1006, "1006"),
    "--max-id-chars": HelmValue("conductor.limits.maxIdChars", 1007, "1007"),
    "--admission": HelmValue("admission.policy", "early", "early"),
    "--default-class": HelmValue("admission.defaultClass", "interactive", "interactive"),
    "--interactive-ttft-ms": HelmValue("admission.classes.interactive.ttftMs", 1500, "1500"),
    "--interactive-tbt-ms": HelmValue("admission.classes.interactive.tbtMs", 120, "120"),
    "--standard-ttft-ms": HelmValue("admission.classes.standard.ttftMs", 2500, "2500"),
    "--standard-tbt-ms": HelmValue("admission.classes.standard.tbtMs", 200.5, "200.5"),
    "--batch-ttft-ms": HelmValue("admission.classes.batch.ttftMs", 0, "0"),
    "--batch-tbt-ms": HelmValue("admission.classes.batch.tbtMs", 50, "50"),
    "--queue-threshold": HelmValue("admission.queueThreshold", 6, "6"),
    "--max-queue-per-worker": HelmValue("admission.maxQueuePerWorker", 64, "64"),
    "--shed-headroom": HelmValue("admission.shedHeadroom", 0.5, "0.5"),
    "--admit-quantile": HelmValue("admission.admitQuantile", 0.95, "0.95"),
    "--admit-window-ms": HelmValue("admission.admitWindowMs", 40, "40"),
    "--no-second-look": HelmValue("admission.secondLook", False, None),
    "--planner": HelmValue("planner.mode", "act", "act"),
    "--planner-interval-s": HelmValue("planner.intervalS", 15, "15"),
    "--planner-window-s": HelmValue("planner.windowS", 45.5, "45.5"),
    "--min-prefill": HelmValue("planner.minPrefill", 2, "2"),
    "--max-prefill": HelmValue("planner.maxPrefill", 6, "6"),
    "--min-decode": HelmValue("planner.minDecode", 1, "1"),
    "--max-decode": HelmValue("planner.maxDecode", 7, "7"),
    "--planner-min-workers": HelmValue("planner.minWorkers", 3, "3"),
    "--planner-max-workers": HelmValue("planner.maxWorkers", 9, "9"),
    "--planner-min-gain": HelmValue("planner.minGain", 0.2, "0.2"),
    "--planner-confirm": HelmValue("planner.confirm", 3, "3"),
    "--planner-judge-s": HelmValue("planner.judgeS", 90, "90"),
    "--planner-rollback-margin": HelmValue("planner.rollbackMargin", 0.1, "0.1"),
    "--planner-cooldown-s": HelmValue("planner.cooldownS", 600, "600"),
    "--planner-drain-s": HelmValue("planner.drainS", 20, "20"),
    "--kv-transport": HelmValue("kvTransport.backend", "ucxx", "ucxx"),
    "--kv-port": HelmValue("kvTransport.port", 5601, "5601"),
    "--ucx-tls": HelmValue("kvTransport.ucxTls", "sm,self", "sm,self"),
    "--ucx-poll-us": HelmValue("kvTransport.ucxPollUs", 0, "0"),
    "--kv-timeout-s": HelmValue("kvTransport.timeoutS", 45, "45"),
    "--kv-max-inflight-mb": HelmValue("kvTransport.maxInflightMb", 128, "128"),
    "--redis-url": HelmValue("redis.external.url", "redis://probe:6379/0", "redis://probe:6379/0"),
    "--model": HelmValue("model.alias", "gemma3-270m", "gemma3-270m"),
    "--dtype": HelmValue("model.dtype", "bfloat16", "bfloat16"),
    "--quantization": HelmValue("model.quantization", "int4", "int4"),
    "--kv-cache-gb": HelmValue("engine.kvCacheGb", 2.5, "2.5"),
    "--num-blocks": HelmValue("engine.numBlocks", 512, "512"),
    "--block-size": HelmValue("engine.blockSize", 32, "32"),
    "--max-num-seqs": HelmValue("engine.maxNumSeqs", 8, "8"),
    "--max-num-batched-tokens": HelmValue("engine.maxNumBatchedTokens", 256, "256"),
    "--max-model-len": HelmValue("engine.maxModelLen", 1024, "1024"),
    "--attention-backend": HelmValue("engine.attentionBackend", "flashinfer", "flashinfer"),
    "--device": HelmValue("engine.device", "cuda", "cuda"),
    "--no-cuda-graphs": HelmValue("engine.cudaGraphs", False, None),
    "--gpu-memory-fraction": HelmValue("engine.gpuMemoryFraction", 0.45, "0.45"),
    "--speculative": HelmValue("engine.speculative.mode", "ngram", "ngram"),
    "--speculative-tokens": HelmValue("engine.speculative.tokens", 6, "6"),
    "--speculative-max-batch": HelmValue("engine.speculative.maxBatch", 4, "4"),
    "--host-cache-gb": HelmValue("kvTiers.hostGb", 2, "2"),
    "--disk-cache-gb": HelmValue("kvTiers.disk.sizeGb", 4, "4"),
    "--disk-cache-dir": HelmValue("kvTiers.disk.mountPath", "/var/lib/probe", "/var/lib/probe"),
    "--api-token-file": HelmValue("auth.existingSecret", "probe-tokens", None),
    "--admin-token-file": HelmValue("auth.admin.existingSecret", "probe-admin", None),
    "--lora": HelmValue("lora.adapters", [{"name": "probe", "path": "/models/probe-lora"}], "probe=/models/probe-lora"),
    "--max-loras": HelmValue("lora.maxLoras", 2, "2"),
    "--max-lora-rank": HelmValue("lora.maxRank", 32, "32"),
    "--max-cpu-loras": HelmValue("lora.maxCpuLoras", 8, "8"),
    "--lora-skip-base-check": HelmValue("lora.baseCheck", False, None),
    "--tls-cert": HelmValue("tls.existingSecret", "probe-tls", None),
    "--tls-key": HelmValue("tls.existingSecret", "probe-tls", None),
    "--no-dashboard": HelmValue("conductor.dashboard", False, None),
    "--tracing": HelmValue("tracing.enabled", True, None),
    "--otlp-endpoint": HelmValue("tracing.endpoint", "http://collector:4317", "http://collector:4317"),
    "--otlp-protocol": HelmValue("tracing.protocol", "grpc", "grpc"),
    "--otel-service-name": HelmValue("tracing.serviceName", "probe-llm", "probe-llm"),
    "--trace-sampler": HelmValue("tracing.sampler", "parentbased_traceidratio", "parentbased_traceidratio"),
    "--trace-sample-ratio": HelmValue("tracing.sampleRatio", 0.25, "0.25"),
    "--otel-resource-attributes": HelmValue("tracing.resourceAttributes", "team=probe,env=test", "team=probe,env=test"),
    "--log-format": HelmValue("logs.format", "json", "json"),
    "--log-level": HelmValue("logs.level", "info", "info"),
}
SERVE_FLAGS_WITHOUT_VALUE: dict[str, str] = {
    "--help": "argparse's own",
    "--config": "the chart passes every option as a flag",
    "--colocated": "the chart runs the cluster: a head pod and worker pods",
    "--max-waiting": "co-located mode only",
    "--threads": "co-located mode only; each worker pins conductor.workerThreads threads",
    "--ray-address": "always `auto`: the Conductor joins the head pod's Ray",
    "--host": "always 0.0.0.0: the Service and the NetworkPolicy decide who reaches the pod",
    "--kv-host": "always 0.0.0.0, advertised as the worker pod's IP",
    "--kv-secret-file": "the secret reaches the workers as HALFMOON_KV_SECRET (kvTransport.secret)",
    "--object-store-mb": "embedded Ray only; the chart's Ray nodes take *.objectStoreMemoryGb",
    "--cost-model": "a file: the first prefill worker profiles itself (or mount one and use extraArgs)",
    "--host-cache-name": "the Conductor names one host-tier arena per node",
    "--no-redis": "the chart always runs a block index (bundled or external Redis)",
    "--dashboard": "on by default; conductor.dashboard=false gives --no-dashboard",
    "--no-tracing": "off by default; tracing.enabled=true gives --tracing",
    "--remote-fetch": "on by default; kvTiers.remoteFetch=false gives --no-remote-fetch",
    "--cuda-graphs": "on by default; engine.cudaGraphs=false gives --no-cuda-graphs",
    "--second-look": "on by default; admission.secondLook=false gives --no-second-look",
    "--lora-base-check": "on by default; lora.baseCheck=false gives --lora-skip-base-check",
    "--no-lora-base-check": "the same as --lora-skip-base-check, which lora.baseCheck=false gives",
}
# What the samples need besides themselves: an external Redis instead of the bundled one.
SAMPLE_EXTRAS = {"redis": {"bundled": {"enabled": False}}}


def serve_flags() -> set[str]:
    return {s for a in serve_parser()._actions for s in a.option_strings if s.startswith("--")}


def lookup(tree: dict, path: str) -> Any:
    for key in path.split("."):
        assert isinstance(tree, dict) and key in tree, f"{path}: no {key!r}"
        tree = tree[key]
    return tree


def nest(path: str, value: Any) -> dict:
    for key in reversed(path.split(".")):
        value = {key: value}
    return value


def test_every_serve_flag_has_a_helm_value_or_a_reason() -> None:
    flags = serve_flags()
    assert not set(SERVE_FLAG_VALUES) & set(SERVE_FLAGS_WITHOUT_VALUE)
    missing = sorted(flags - set(SERVE_FLAG_VALUES) - set(SERVE_FLAGS_WITHOUT_VALUE))
    assert not missing, f"`halfmoon serve` flags without a Helm value (or a reason in this file): {missing}"
    stale = sorted((set(SERVE_FLAG_VALUES) | set(SERVE_FLAGS_WITHOUT_VALUE)) - flags)
    assert not stale, f"not `halfmoon serve` flags any more: {stale}"
    assert all(SERVE_FLAGS_WITHOUT_VALUE.values())


def schema_of(schema: dict, path: str) -> dict:
    """The schema of the value at dotted `path` (following `#/definitions/...` references)."""
    node = schema
    for key in path.split("."):
        if "$ref" in node:
            node = lookup(schema, node["$ref"].removeprefix("#/").replace("/", "."))
        node = lookup(node, f"properties.{key}")
    return node


def test_each_flags_value_is_in_values_yaml_and_the_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    for value in SERVE_FLAG_VALUES.values():
        lookup(values, value.path)
        assert "type" in schema_of(schema, value.path), value.path


def test_each_flags_value_reaches_the_conductors_command(renderer: Renderer) -> None:
    values = SAMPLE_EXTRAS
    for value in SERVE_FLAG_VALUES.values():
        values = merge(values, nest(value.path, value.sample))
    docs = [doc for path, text in sorted(renderer.render(values).items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]
    args = head_container(Release(renderer.chart.merge_values(values), docs, ""))["args"]
    parse_serve(args)
    given = dict(zip(args[:-1], args[1:], strict=True))
    for flag, value in SERVE_FLAG_VALUES.items():
        assert flag in given, f"{value.path}={value.sample!r} does not give {flag}"
        if value.arg is not None:
            assert given[flag] == value.arg, f"{value.path}={value.sample!r} gives {flag} {given[flag]}"


@pytest.mark.parametrize("kuberay", [False, True])
def test_standby_adds_one_worker_pod_per_role_and_the_flag(renderer: Renderer, kuberay: bool) -> None:
    """conductor.standby = 1: each role's group runs replicas + 1 pods (the standby actor needs a
    node advertising the role's resource) and the Conductor gets `--standby 1`."""
    values = {"conductor": {"standby": 1}, "prefill": {"replicas": 2}, "decode": {"replicas": 1},
              "kuberay": {"enabled": kuberay}}
    docs = [d for path, text in renderer.render(values).items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    if kuberay:
        cluster = next(d for d in docs if d["kind"] == "RayCluster")
        pods = {g["groupName"]: g["replicas"] for g in cluster["spec"]["workerGroupSpecs"]}
    else:
        pods = {d["metadata"]["name"].rsplit("-", 1)[1]: d["spec"]["replicas"] for d in docs
                if d["kind"] == "StatefulSet" and not d["metadata"]["name"].endswith("redis")}
    assert pods == {"prefill": 3, "decode": 2}
    args = [a for d in docs if d["kind"] in ("Deployment", "RayCluster") for a in _conductor_args(d)]
    assert args[args.index("--standby") + 1] == "1"


def _conductor_args(doc: dict) -> list[str]:
    spec = doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment" else \
        doc["spec"]["headGroupSpec"]["template"]["spec"]
    return [str(a) for c in spec["containers"] for a in c.get("args") or []]
