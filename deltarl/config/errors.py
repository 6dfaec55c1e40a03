"""What a configuration that cannot run a daemon raises, and the exit status it becomes."""

from __future__ import annotations

EX_CONFIG = 78  # sysexits.h: configuration error; the units do not restart on it


class ConfigError(ValueError):
    """The configuration cannot run this daemon; the message names the file, table and key."""
