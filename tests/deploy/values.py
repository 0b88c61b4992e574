"""Helm values as the chart sees them: merged over the defaults, nulls dropped."""

from __future__ import annotations


def merge(base: dict, override: dict) -> dict:
    """Helm's merge of values files: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def drop_nulls(values: dict) -> dict:
    return {k: drop_nulls(v) if isinstance(v, dict) else v for k, v in values.items() if v is not None}
