"""Flags generated from the config dataclasses (cli/flags.py, cli/components.py): every field is a
flag or excluded with a reason, every flag is documented, and a value's precedence is
flag > HALFMOON_* > --config YAML > the field's default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from halfmoon.cli.components import (ADMISSION, CLUSTER, ENGINE, LIMITS, LOGGING, SERVE, SERVE_ENGINE,
                            SERVER, TRACING, TRANSPORT)
from halfmoon.cli.flags import Component, Flag, add_flags, build, env_var, field_docs
from halfmoon.cli.planner_flags import PLANNER, add_planner_flags, planner_config
from halfmoon.cli.main import build_parser, parse_args, subparser
from halfmoon.conductor.admission import AdmissionConfig
from halfmoon.conductor.cluster_config import ClusterConfig
from halfmoon.conductor.planner import PlannerConfig
from halfmoon.api.requests import Limits
from halfmoon.conductor.serve_defaults import SERVE_PREFILL_MAX_SEQS, serve_cluster, serve_engine
from halfmoon.api.server import ServerConfig
from halfmoon.core.errors import ConfigError
from halfmoon.core.logs import LogConfig
from halfmoon.core.tracing import TracingConfig
from halfmoon.engine.config import EngineConfig
from halfmoon.transport.config import TransportConfig

COMPONENTS = (ENGINE, TRANSPORT, CLUSTER, PLANNER, LIMITS, SERVER, ADMISSION, TRACING, LOGGING)


def options(command: str) -> dict[str, argparse.Action]:
    parser = subparser(build_parser(), command)
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("component", COMPONENTS, ids=lambda c: c.cls.__name__)
def test_every_field_is_a_flag_or_excluded_with_a_reason(component: Component) -> None:
    """Adding a field to a config class adds its flag (or this fails: exclude it, with why)."""
    names = {f.name for f in dataclasses.fields(component.cls)}
    for table in (component.flags, component.nested, component.excluded):
        assert set(table) <= names, f"{component.cls.__name__}: not fields: {set(table) - names}"
    assert not set(component.nested) & set(component.excluded)
    assert all(component.excluded.values()), "every exclusion says why"
    commands = ("serve",) if component is not ENGINE else ("serve", "generate", "profile")
    for command in commands:
        flags = options(command)
        for f in component.flag_fields():
            if command == "serve" and component is ENGINE and f.name in SERVE_ENGINE.excluded:
                continue  # serve's own exclusions (with their reasons)
            action = flags.get(f"--{component.flag_name(f.name)}")
            assert action is not None, f"{command}: no flag for {component.cls.__name__}.{f.name}"
            assert action.help and not action.help.startswith("[env"), f"undocumented: {f.name}"


def test_the_serve_components_cover_every_config_class() -> None:
    covered = {c.cls for c in SERVE} | {c.cls for top in SERVE for c in top.nested.values()}
    assert covered == {EngineConfig, TransportConfig, ClusterConfig, PlannerConfig, Limits, ServerConfig,
                       AdmissionConfig, TracingConfig, LogConfig}


def test_existing_flag_names_keep_working() -> None:
    flags = options("serve")
    for name in ("--threads", "--kv-transport", "--kv-host", "--kv-port", "--kv-secret-file",
                 "--max-tokens-limit", "--worker-threads", "--ucx-poll-us", "--prefill-gpus"):
        assert name in flags, name


def test_defaults_build_the_default_configs() -> None:
    args = parse_args(["serve"])
    # serve keeps a host tier by default; the engine commands keep the field's default, none
    assert build(SERVE_ENGINE, args) == serve_engine() != EngineConfig()
    assert build(ENGINE, parse_args(["generate", "--prompt", "hi"])) == EngineConfig()
    assert build(SERVER, args) == ServerConfig()
    assert build(ADMISSION, args) == AdmissionConfig()
    assert build(TRANSPORT, args, host="127.0.0.1") == TransportConfig()
    # serve steps one prompt at a time on a prefill worker (conductor/serve_defaults.py) and its
    # planner advises; a ClusterConfig built in code has none (its backend has no advisor)
    assert ClusterConfig().planner.mode == "off"
    assert build(CLUSTER, args, transport=TransportConfig(), engine=EngineConfig(),
                 model_id="smollm2") == dataclasses.replace(ClusterConfig(), prefill_max_seqs=SERVE_PREFILL_MAX_SEQS,
                                                            planner=PlannerConfig(mode="advise"))
    assert serve_cluster().prefill_max_seqs == SERVE_PREFILL_MAX_SEQS


def test_flags_become_fields() -> None:
    args = parse_args(["serve", "--threads", "3", "--kv-cache-gb", "0.5", "--max-tokens-limit", "99",
                       "--kv-transport", "tcp", "--kv-timeout-s", "5"])
    assert (build(SERVE_ENGINE, args).num_threads, build(SERVE_ENGINE, args).kv_cache_gb) == (3, 0.5)
    assert build(SERVER, args).limits.max_tokens == 99
    transport = build(TRANSPORT, args, host="0.0.0.0")
    assert (transport.backend, transport.timeout_s, transport.host) == ("tcp", 5.0, "0.0.0.0")


def test_admission_flags_env_and_choices(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HALFMOON_SHED_HEADROOM", "0.5")
    args = parse_args(["serve", "--admission", "early", "--default-class", "interactive",
                       "--interactive-ttft-ms", "500", "--batch-tbt-ms", "0", "--queue-threshold", "2"])
    cfg = build(ADMISSION, args)
    assert (cfg.admission, cfg.default_class, cfg.interactive_ttft_ms) == ("early", "interactive", 500.0)
    assert (cfg.batch_tbt_ms, cfg.queue_threshold, cfg.shed_headroom) == (0.0, 2, 0.5)
    flags = options("serve")
    assert flags["--admission"].choices == ("none", "queue-threshold", "early", "predictive")
    assert flags["--default-class"].choices == ("interactive", "standard", "batch")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--admission", "lottery"])
    assert "invalid choice: 'lottery'" in capsys.readouterr().err
    monkeypatch.setenv("HALFMOON_ADMISSION", "lottery")
    with pytest.raises(ConfigError, match="HALFMOON_ADMISSION"):
        parse_args(["serve"])
    monkeypatch.delenv("HALFMOON_ADMISSION")
    with pytest.raises(ConfigError, match="interactive_tbt_ms must be a finite number >= 0"):
        build(ADMISSION, parse_args(["serve", "--interactive-tbt-ms", "-1"]))


def test_precedence_flag_env_yaml_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 7\nblock_size: 32\nkv_cache_gb: 0.25\n")
    monkeypatch.setenv("HALFMOON_BLOCK_SIZE", "8")
    monkeypatch.setenv("HALFMOON_KV_CACHE_GB", "0.75")
    args = parse_args(["serve", "--config", str(config), "--kv-cache-gb", "2"])
    engine = build(SERVE_ENGINE, args)
    assert engine.kv_cache_gb == 2.0  # flag > env > YAML
    assert engine.block_size == 8  # env > YAML
    assert engine.max_num_seqs == 7  # YAML > default
    assert engine.max_num_batched_tokens == EngineConfig().max_num_batched_tokens


def test_a_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFMOON_BLOCK_SIZE", "big")
    with pytest.raises(ConfigError, match="HALFMOON_BLOCK_SIZE"):
        parse_args(["serve"])
    monkeypatch.setenv("HALFMOON_BLOCK_SIZE", "16")
    monkeypatch.setenv("HALFMOON_KV_TRANSPORT", "pigeon")
    with pytest.raises(ConfigError, match="choose one of auto, ucxx, tcp"):
        parse_args(["serve"])


def test_an_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("no_such_option: 1\n")
    with pytest.raises(ConfigError, match="unknown option 'no_such_option'"):
        parse_args(["serve", "--config", str(config)])


def test_a_field_error_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max_tokens must be > 0"):
        build(SERVER, parse_args(["serve", "--max-tokens-limit", "0"]))


def test_env_var_names_and_docstring_lines() -> None:
    assert env_var("kv-cache-gb") == "HALFMOON_KV_CACHE_GB"

    @dataclasses.dataclass(frozen=True)
    class Demo:
        """A demo.

        alpha / beta: shared text,
            continued here.
        gamma: 100% documented.
        """

        alpha: int = 1
        beta: float | None = None
        gamma: str = "x"
        hidden: bool = False

    assert field_docs(Demo) == {"alpha": "shared text, continued here.",
                                "beta": "shared text, continued here.", "gamma": "100% documented."}
    parser = argparse.ArgumentParser()
    add_flags(parser, Component(Demo, "demo", flags={"gamma": Flag("g")}, excluded={"hidden": "why"}))
    args = parser.parse_args(["--alpha", "2", "--beta", "0.5", "--g", "y"])
    assert build(Component(Demo, "demo", flags={"gamma": Flag("g")}, excluded={"hidden": "why"}),
                 args) == Demo(2, 0.5, "y")
    assert "100% documented." in parser.format_help()


def test_lora_flags_reach_every_engine_and_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-loras, --max-lora-rank, --max-cpu-loras, --lora-skip-base-check are EngineConfig's,
    the same for the co-located engine and every cluster worker; --lora NAME=PATH is the server's
    (repeatable; HALFMOON_LORA=NAME=PATH,... when no flag gives one)."""
    from halfmoon.cli.serve import cluster_config, lora_adapters

    monkeypatch.delenv("HALFMOON_LORA", raising=False)
    args = parse_args(["serve", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "3",
                       "--lora-skip-base-check", "--lora", "a=/adapters/a", "--lora", "b=/adapters/b"])
    engine = build(SERVE_ENGINE, args)
    lora = ("max_loras", "max_lora_rank", "max_cpu_loras", "lora_base_check")
    assert tuple(getattr(engine, f) for f in lora) == (2, 8, 3, False)
    worker = cluster_config(args, engine).engine
    assert tuple(getattr(worker, f) for f in lora) == (2, 8, 3, False)
    assert lora_adapters(args.lora) == (("a", "/adapters/a"), ("b", "/adapters/b"))
    assert build(SERVER, args, lora_adapters=lora_adapters(args.lora)).lora_adapters == lora_adapters(args.lora)
    defaults = parse_args(["serve"])
    assert build(SERVE_ENGINE, defaults).lora_base_check and lora_adapters(defaults.lora) == ()
    assert not build(SERVE_ENGINE, parse_args(["serve", "--no-lora-base-check"])).lora_base_check
    monkeypatch.setenv("HALFMOON_MAX_LORA_RANK", "32")
    monkeypatch.setenv("HALFMOON_LORA", "a=/x, b=/y")
    assert build(SERVE_ENGINE, parse_args(["serve"])).max_lora_rank == 32
    assert lora_adapters(parse_args(["serve"]).lora) == (("a", "/x"), ("b", "/y"))
    assert lora_adapters(["c=/z"]) == (("c", "/z"),)  # a flag wins over the variable
    with pytest.raises(ConfigError, match="expected NAME=PATH"):
        lora_adapters(["just-a-name"])
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        build(SERVE_ENGINE, parse_args(["serve", "--max-loras", "8", "--max-cpu-loras", "4"]))


def test_planner_flags_env_and_bounds_build_the_cluster_planner(monkeypatch: pytest.MonkeyPatch) -> None:
    """--planner and its options (HALFMOON_* twins) build ClusterConfig.planner; advise by default."""
    from halfmoon.cli.serve import cluster_config

    assert cluster_config(parse_args(["serve"]), EngineConfig()).planner == PlannerConfig()
    assert PlannerConfig().mode == "advise"
    monkeypatch.setenv("HALFMOON_PLANNER_WINDOW_S", "45")
    monkeypatch.setenv("HALFMOON_MAX_DECODE", "3")
    args = parse_args(["serve", "--prefill", "2", "--decode", "2", "--planner", "act", "--planner-interval-s", "2",
                       "--min-prefill", "1", "--max-prefill", "3", "--min-decode", "1", "--planner-min-workers", "3",
                       "--planner-max-workers", "5", "--planner-min-gain", "0.2", "--planner-confirm", "3",
                       "--planner-judge-s", "20", "--planner-rollback-margin", "0.1", "--planner-cooldown-s", "60",
                       "--planner-drain-s", "4"])
    planner = cluster_config(args, EngineConfig()).planner
    assert planner == PlannerConfig("act", 2.0, 45.0, 1, 3, 1, 3, 3, 5, 0.2, 3, 20.0, 0.1, 60.0, 4.0)
    assert planner_config(args) == planner  # the same table `halfmoon sim` adds
    assert options("serve")["--planner"].choices == ("off", "advise", "act")


@pytest.mark.parametrize("argv, message", [
    (["--planner-interval-s", "0"], "interval_s must be > 0"),
    (["--min-decode", "3", "--max-decode", "2"], "bounds of the decode pool"),
    (["--planner-min-workers", "4", "--planner-max-workers", "2"], "max_workers 2 < min_workers 4"),
    (["--planner-confirm", "0"], "confirm must be >= 1"),
])
def test_a_bad_planner_value_exits_2_with_the_reason(argv: list[str], message: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    from halfmoon.cli.main import main

    assert main(["serve", *argv]) == 2  # refused before anything starts (no Redis, no Ray)
    assert message in capsys.readouterr().err


def test_a_bad_planner_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFMOON_PLANNER", "autopilot")
    with pytest.raises(ConfigError, match="HALFMOON_PLANNER='autopilot': choose one of off, advise, act"):
        parse_args(["serve"])


def test_planner_flags_stand_alone_for_sim() -> None:
    """`halfmoon sim` adds the same flags to its own parser (no engine, no cluster flags)."""
    parser = argparse.ArgumentParser()
    add_planner_flags(parser)
    config = planner_config(parser.parse_args(["--planner", "off", "--max-prefill", "40"]))
    assert (config.mode, config.max_prefill, config.max_decode) == ("off", 40, None)


def test_colocated_notes_the_unused_planner_only_when_asked() -> None:
    from halfmoon.cli.serve import colocated_notes

    assert colocated_notes(parse_args(["serve", "--colocated"]), PlannerConfig()) == []
    args = parse_args(["serve", "--colocated", "--planner", "act"])
    (note,) = colocated_notes(args, planner_config(args))
    assert "--planner act and its options are unused with --colocated" in note
