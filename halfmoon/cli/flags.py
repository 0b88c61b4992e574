"""Command-line flags generated from a config dataclass's `fields()`, and the dataclass built back.

One field = one flag, `--field-name` unless the component's table renames it. Its type comes from
the annotation (`int | None` -> int), its default from the field, its help from the class
docstring's `name: ...` line (or the table). Where a value comes from, first found wins:

    the flag  >  $HALFMOON_<FLAG_UPPER_SNAKE>  >  `--config` YAML  >  the field's default

Fields that are no flag (set by the cluster, or built from another component) are listed in the
component's `excluded` table with the reason; `tests/cli/test_flags.py` fails on a field that is
neither.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from halfmoon.core.errors import ConfigError, HalfmoonError

ENV_PREFIX = "HALFMOON_"
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
# A docstring line documenting fields: `name: text` or `name / other: text`, at the left margin.
_DOC_LINE = re.compile(r"^([a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):\s+(.*)$")


class Flag(NamedTuple):
    """How one field differs from its generated flag (None = as generated)."""

    name: str | None = None  # the flag without `--` (default: the field name with `-`)
    help: str | None = None  # default: the field's docstring line
    choices: tuple[str, ...] | None = None
    default: Any = dataclasses.MISSING  # a different CLI default (e.g. None = derived later)


@dataclasses.dataclass(frozen=True)
class Component:
    """One config dataclass as command-line flags.

    flags: per-field differences from the generated flag (renames where the CLI name differs).
    nested: fields that are themselves a component, built from that component's flags.
    excluded: fields that are no flag, with the reason (they keep their default or are given
        to `build`).
    """

    cls: type
    title: str
    flags: Mapping[str, Flag] = dataclasses.field(default_factory=dict)
    nested: Mapping[str, Component] = dataclasses.field(default_factory=dict)
    excluded: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def flag_fields(self) -> list[dataclasses.Field]:
        """The fields that are flags of this component itself (not nested, not excluded)."""
        skip = {*self.nested, *self.excluded}
        return [f for f in dataclasses.fields(self.cls) if f.name not in skip]

    def flag_name(self, field: str) -> str:
        return self.flags.get(field, Flag()).name or field.replace("_", "-")

    def dest(self, field: str) -> str:
        return self.flag_name(field).replace("-", "_")

    def dests(self) -> set[str]:
        """Every argparse dest of this component and its nested ones."""
        own = {self.dest(f.name) for f in self.flag_fields()}
        return own.union(*(c.dests() for c in self.nested.values()))


def env_var(flag_name: str) -> str:
    """`kv-cache-gb` -> `HALFMOON_KV_CACHE_GB`."""
    return ENV_PREFIX + flag_name.upper().replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, component: Component) -> None:
    """Add one argument group per component (then its nested ones, each under its own title)."""
    hints = typing.get_type_hints(component.cls)
    docs = field_docs(component.cls)
    group = parser.add_argument_group(component.title)
    for f in component.flag_fields():
        _add_flag(group, component, f, _scalar(hints[f.name]), docs.get(f.name))
    for child in component.nested.values():
        add_flags(parser, child)


def _add_flag(group: argparse._ArgumentGroup, component: Component, f: dataclasses.Field,
              kind: type, doc: str | None) -> None:
    spec = component.flags.get(f.name, Flag())
    name = component.flag_name(f.name)
    default = f.default if spec.default is dataclasses.MISSING else spec.default
    if default is dataclasses.MISSING:
        raise TypeError(f"{component.cls.__name__}.{f.name} has no default: give it one in the table")
    env = os.environ.get(env_var(name))
    if env is not None:
        default = _from_env(env_var(name), env, kind, spec.choices)
    text = (spec.help or doc or "").replace("%", "%%")
    kwargs: dict[str, Any] = {"default": default, "help": f"{text} [env {env_var(name)}]".lstrip()}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=kind, choices=spec.choices)
    group.add_argument(f"--{name}", **kwargs)


def build(component: Component, args: argparse.Namespace, **given: Any) -> Any:
    """The component's dataclass from parsed `args`; `given` fields win over the flags.

    A field's validation error (ValueError) becomes a ConfigError, so the CLI prints it cleanly.
    """
    values = {f.name: getattr(args, component.dest(f.name)) for f in component.flag_fields()}
    values |= {name: build(child, args) for name, child in component.nested.items() if name not in given}
    try:
        return component.cls(**(values | given))
    except ValueError as e:
        if isinstance(e, HalfmoonError):
            raise
        raise ConfigError(str(e)) from e


def field_docs(cls: type) -> dict[str, str]:
    """`name -> text` from the class docstring's `name: text` lines (continuations joined)."""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        match = _DOC_LINE.match(line)
        if match:
            current = [match.group(2)]
            docs |= dict.fromkeys(re.split(r"\s*/\s*", match.group(1)), current)
        elif line.startswith(" ") and current is not None:
            current.append(line.strip())
        else:
            current = None
    return {name: " ".join(parts) for name, parts in docs.items()}


def _scalar(hint: Any) -> type:
    """`int | None` -> int, `Literal["a", "b"]` -> str; a flag's value is one str, int, float or bool."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(hint)):
        hint = str  # the table gives the choices
    if hint not in (str, int, float, bool):
        raise TypeError(f"no flag type for {hint!r}: make it a nested component or exclude it")
    return hint


def _from_env(name: str, text: str, kind: type, choices: tuple[str, ...] | None) -> Any:
    """The value of environment variable `name`, converted as its flag would be."""
    if kind is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ConfigError(f"{name}={text!r}: expected one of {sorted(_TRUE | _FALSE)}")
        return text.lower() in _TRUE
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r}: expected {kind.__name__}") from None
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={text!r}: choose one of {', '.join(choices)}")
    return value


def apply_config_file(parser: argparse.ArgumentParser, path: str, env_dests: set[str]) -> None:
    """Make the `--config` YAML's values `parser`'s defaults (parse again to apply them).

    Keys are the options' dests (flags with `_` for `-`). A dest in `env_dests` whose environment
    variable is set keeps that value: the environment beats the file.
    """
    data = _read_yaml(path)
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    defaults = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in dests:
            raise ConfigError(f"--config {path}: unknown option {key!r}")
        if not (dest in env_dests and env_var(dest) in os.environ):
            defaults[dest] = value
    parser.set_defaults(**defaults)


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read --config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value")
    return data
