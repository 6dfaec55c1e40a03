"""A ``[daemons.NAME]`` table to its config class: keys, types, nested tables.

The loader checks what a type hint can say (unknown and missing keys, each value's type,
``Path`` from a string, ``float`` from an int, ``Literal`` choices) and builds nested tables
into their classes: a field typed as a config class is a sub-table, a tuple of one is an
array of tables, and a union of classes with a ``type`` field (the links) is chosen by the
table's ``type``. What a type cannot say (a positive count, an endpoint's scheme) each class
checks in its own ``__post_init__`` (``deltarl.config.checks``); its ValueError becomes a
ConfigError here that names the file, the table and the key.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from deltarl.config.errors import ConfigError
from deltarl.config.files import config_path, load_config

T = TypeVar("T")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _variants(hint: Any) -> tuple[Any, ...]:  # noqa: ANN401 - a type hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _by_type(where: str, classes: list[type], value: Any) -> Any:  # noqa: ANN401 - TOML value
    """A table whose ``type`` key chooses one of ``classes`` (each has a ``type`` field)."""
    kinds = {f.default: c for c in classes for f in dataclasses.fields(c) if f.name == "type"}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a table with type = one of {sorted(kinds)}")
    cls = kinds.get(value.get("type"))
    if cls is None:
        got = value.get("type")
        raise ConfigError(f"{where}: type must be one of {sorted(kinds)}, got {got!r}")
    return build(cls, where, value)


def _convert(where: str, hint: Any, value: Any) -> Any:  # noqa: ANN401, PLR0911
    """``value`` checked against (and coerced to) ``hint``, else ConfigError."""
    variants = _variants(hint)
    if len(variants) > 1:
        inner = [v for v in variants if v is not type(None)]
        if value is None and len(inner) < len(variants):
            return None
        if len(inner) > 1 and all(dataclasses.is_dataclass(v) for v in inner):
            return _by_type(where, inner, value)
        if len(inner) == 1:
            return _convert(where, inner[0], value)
        raise ConfigError(f"{where}: cannot read a value of type {hint}")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return build(typing.cast("type", hint), where, value)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be an array, got {value!r}")
        return tuple(_convert(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if origin is dict or hint is dict:
        if isinstance(value, dict):
            return dict(value)  # a free-form table, checked by whoever reads it
        raise ConfigError(f"{where} must be a table, got {value!r}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
    if hint is bool and isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is str and isinstance(value, str):
        return value
    if getattr(hint, "__name__", "") == "Path" and isinstance(value, str):
        return hint(value)
    raise ConfigError(f"{where} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def build(cls: type[T], where: str, table: Mapping[str, Any]) -> T:
    """``table`` as ``cls``; ConfigError naming ``where`` and the key if it cannot be."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    names = {f.name for f in fields}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in fields:
        if f.name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing key {f.name!r}")
            continue
        values[f.name] = _convert(f"{where}: {f.name}", hints[f.name], table[f.name])
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def load(cls: type[T], daemon: str, path: str | None) -> T:
    """The ``[daemons.<daemon>]`` table of the config file as ``cls``; ConfigError if unusable."""
    found = config_path(path)
    if found is None:
        raise ConfigError("no config: use --config FILE or set DELTARL_CONFIG")
    raw = load_config(found)
    daemons = raw.get("daemons")
    table = daemons.get(daemon) if isinstance(daemons, dict) else None
    if not isinstance(table, dict):
        raise ConfigError(f"config {found} has no [daemons.{daemon}] table")
    return build(cls, f"config {found}: [daemons.{daemon}]", table)
