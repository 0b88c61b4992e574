"""The built-in GPU cost models shipped in sim/profiles/ (sources cited in each file and in
sim/profiles/README.md), by name: `llama3-8b-h100` is sim/profiles/llama3-8b-h100.json."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from halfmoon.core.errors import ConfigError

if TYPE_CHECKING:  # names() runs when `halfmoon --help` is built: nothing heavy at import
    from halfmoon.conductor.cost_model import CostModel

PROFILES = Path(__file__).resolve().parent / "profiles"


def names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load(name: str) -> CostModel:
    """The named built-in profile; ConfigError listing the names when there is none."""
    from halfmoon.conductor.cost_model import CostModel

    if name not in names():
        raise ConfigError(f"no built-in profile {name!r}; one of {names()}")
    return CostModel.load(PROFILES / f"{name}.json")
