"""The one validation style of every config class: ``__post_init__`` calls these.

Each raises ValueError naming the key; the loader (``tables.build``) turns it into a
ConfigError that also names the file and the table. A class built in code (a test, a bench)
is checked the same way as one read from a file.
"""

from __future__ import annotations

from typing import Any

from deltarl.transport.control import check_endpoint


def positive(owner: object, *keys: str) -> None:
    """Each key's value (None allowed: "not set") is > 0."""
    for key in keys:
        value = getattr(owner, key)
        if value is not None and not value > 0:
            raise ValueError(f"{key} must be positive, got {value}")


def non_negative(owner: object, *keys: str) -> None:
    for key in keys:
        value = getattr(owner, key)
        if value is not None and value < 0:
            raise ValueError(f"{key} must not be negative, got {value}")


def at_least(owner: object, low: int, *keys: str) -> None:
    """Each key's value is an integer >= ``low`` (a count with a floor, such as a retention)."""
    for key in keys:
        value = getattr(owner, key)
        if value < low:
            raise ValueError(f"{key} must be at least {low}, got {value}")


def endpoints(owner: object, *keys: str) -> None:
    """Each key (None allowed) is an ``ipc://`` or ``tcp://`` endpoint."""
    for key in keys:
        value: Any = getattr(owner, key)
        if value is not None:
            try:
                check_endpoint(value)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None


def within(owner: object, key: str, low: float, high: float) -> None:
    value = getattr(owner, key)
    if not low <= value <= high:
        raise ValueError(f"{key} must lie in [{low}, {high}], got {value}")
