"""`--quantization` (issue 23): a generated engine flag with its env variable, on every command
that builds an engine."""

from __future__ import annotations

import pytest

from halfmoon.cli.components import ENGINE, SERVE_ENGINE
from halfmoon.cli.flags import build
from halfmoon.cli.main import parse_args
from halfmoon.core.errors import ConfigError


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "hi"], ["profile"]], ids=lambda c: c[0])
def test_the_flag_reaches_the_engine_config(command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SERVE_ENGINE if command[0] == "serve" else ENGINE  # serve's engine flags (no --tp)
    assert build(engine, parse_args(command)).quantization == "none"
    assert build(engine, parse_args([*command, "--quantization", "int4"])).quantization == "int4"
    monkeypatch.setenv("HALFMOON_QUANTIZATION", "int8")
    assert build(engine, parse_args(command)).quantization == "int8"


def test_a_bad_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit):
        parse_args(["serve", "--quantization", "int3"])
    monkeypatch.setenv("HALFMOON_QUANTIZATION", "fp8")
    with pytest.raises(ConfigError, match="HALFMOON_QUANTIZATION"):
        parse_args(["serve"])
