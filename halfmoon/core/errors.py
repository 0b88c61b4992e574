"""The base errors every room raises or maps.

`HalfmoonError` is the root of every error Halfmoon raises on purpose; the API layer maps each
class to exactly one gRPC status / HTTP code (conductor/errors.py). Room-specific errors subclass
these in their own package (engine/errors.py, kvpool/errors.py, transport/errors.py, ...).
"""

from __future__ import annotations


class HalfmoonError(Exception):
    """Base of every error Halfmoon raises on purpose."""


class StructuredError(Exception):
    """An error made of named values: `fields` name them (in constructor order), `template`
    formats them into the message, and each is an attribute. It pickles back to itself by its
    values (Ray and subprocesses ship exceptions; by default one is rebuilt from its message
    alone, which fails for a constructor with other arguments)."""

    fields: tuple[str, ...] = ()
    template = ""

    def __init__(self, *values: object, **named: object) -> None:
        given = dict(zip(self.fields, values), **named)
        if len(values) > len(self.fields) or set(given) != set(self.fields):
            raise TypeError(f"{type(self).__name__} takes {', '.join(self.fields)}")
        for name in self.fields:
            setattr(self, name, given[name])
        super().__init__(self.describe())

    def describe(self) -> str:
        return self.template.format(**{name: getattr(self, name) for name in self.fields})

    def __reduce__(self) -> tuple[type[StructuredError], tuple[object, ...]]:
        return (type(self), tuple(getattr(self, name) for name in self.fields))


class InvalidRequestError(StructuredError, HalfmoonError, ValueError):
    """A request parameter is invalid; `field` names it so a client can fix it."""

    field: str
    message: str
    fields = ("field", "message")
    template = "{field}: {message}"


class ConfigError(HalfmoonError, ValueError):
    """A configuration value is invalid."""


def check_positive(config: object, *names: str, error: type[Exception] = ConfigError) -> None:
    """Raise `error` naming the first of `config`'s fields `names` that is set (not None) and
    not > 0: the check every config dataclass makes of its sizes, counts and timeouts."""
    for name in names:
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise error(f"{name} must be > 0, got {value}")
