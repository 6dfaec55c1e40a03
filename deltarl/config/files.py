"""Which configuration file to read, reading it, and writing one.

Every daemon, ``deltarl ctl`` and ``deltarl up`` read the same file (TOML, or JSON for a
``.json`` path): ``--config FILE``, else ``$DELTARL_CONFIG``, else /etc/deltarl/deltarl.toml.
``write_toml`` is the one writer of configuration files: ``deltarl up``, the benchmarks and
the tests build their tables as Python values and write them with it, so no TOML is written
by hand twice.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from deltarl.config.errors import ConfigError

CONFIG_ENV = "DELTARL_CONFIG"
DEFAULT_CONFIG = Path("/etc/deltarl/deltarl.toml")


def config_path(explicit: str | None, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Which configuration to read: the flag, the environment, the default if it exists."""
    if explicit:
        return Path(explicit)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    return DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None


def load_config(path: Path) -> dict[str, Any]:
    """The configuration at ``path``: JSON if it ends in ``.json``, TOML otherwise."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    try:
        config = orjson.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (orjson.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config {path} must be a table/object at the top level")
    return config


# -- the writer -------------------------------------------------------------------------------


def _scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str | Path):
        return orjson.dumps(str(value)).decode()  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple) and not any(isinstance(v, Mapping) for v in value):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to TOML")


def _key(key: str) -> str:
    plain = key.replace("-", "").replace("_", "").isalnum() and key.isascii()
    return key if plain else orjson.dumps(key).decode()


def _tables(name: str, table: Mapping[str, Any], out: list[str]) -> None:
    """``table`` under the header ``name``: scalars first, then sub-tables, then arrays of
    tables (TOML needs a table's own keys before any sub-table header)."""
    scalars = {k: v for k, v in table.items() if v is not None and not _nested(v)}
    if name and (scalars or not table):
        out.append(f"\n[{name}]")
    out.extend(f"{_key(k)} = {_scalar(v)}" for k, v in scalars.items())
    for key, value in table.items():
        child = f"{name}.{_key(key)}" if name else _key(key)
        if isinstance(value, Mapping):
            _tables(child, value, out)
        elif _nested(value):
            for item in value:
                out.append(f"\n[[{child}]]")
                inner: list[str] = []
                _tables(child, item, inner)
                out.extend(line for line in inner if line != f"\n[{child}]")


def _nested(value: object) -> bool:
    return isinstance(value, Mapping) or (
        isinstance(value, list | tuple) and bool(value) and isinstance(value[0], Mapping)
    )


def toml_text(config: Mapping[str, Any]) -> str:
    """``config`` (tables of str, int, float, bool, Path, lists, None = left out) as TOML."""
    out: list[str] = []
    _tables("", config, out)
    return "\n".join(out).lstrip("\n") + "\n"


def write_toml(path: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config`` to ``path`` as TOML (checked by reading it back); returns ``path``."""
    text = toml_text(config)
    tomllib.loads(text)  # the writer's own check: what it wrote must read back
    path.write_text(text)
    return path
