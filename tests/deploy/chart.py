"""The chart under test and its renderer, shared by the deploy tests: Helm 4's engine through
`helm-python-sdk` renders offline (no cluster, no network, no helm binary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml

from tests.deploy.values import merge

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "halfmoon"
PROFILES = ROOT / "helm" / "profiles"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "hm", "serving"
FULLNAME = f"{RELEASE}-halfmoon"

# Variant name -> values files, in `helm -f` order (later files win).
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "cpu-small": ["cpu-small.yaml"],
    "gpu-1p1d": ["gpu-1p1d.yaml"],
    "gpu-4p4d-external-redis": ["gpu-4p4d-external-redis.yaml"],
    "cpu-small+kuberay": ["cpu-small.yaml", "kuberay.yaml"],
    "gpu-1p1d+kuberay": ["gpu-1p1d.yaml", "kuberay.yaml"],
}


def user_values(variant: str) -> dict:
    values: dict = {}
    for name in VARIANTS[variant]:
        values = merge(values, yaml.safe_load((PROFILES / name).read_text()))
    return values


class Release(NamedTuple):
    """One rendered release: its effective values and its manifests."""

    values: dict
    docs: list[dict]
    notes: str

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, got {len(found)}"
        return found[0]


class Renderer:
    """Renders the chart once per variant (Helm's engine is fast, but every test reuses them)."""

    def __init__(self, chart: Any) -> None:
        self.chart = chart
        self.cache: dict[str, Release] = {}

    def render(self, values: dict) -> dict[str, str]:
        return self.chart.render(values, name=RELEASE, namespace=NAMESPACE)

    def release(self, variant: str) -> Release:
        if variant not in self.cache:
            self.cache[variant] = self.release_with(user_values(variant))
        return self.cache[variant]

    def release_with(self, values: dict) -> Release:
        files = self.render(values)
        docs = [doc for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
                for doc in yaml.safe_load_all(text) if doc]
        return Release(self.chart.merge_values(values), docs, files.get("halfmoon/templates/NOTES.txt", ""))
