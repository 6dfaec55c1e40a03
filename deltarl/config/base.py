"""What every daemon's configuration class is: one ``[daemons.NAME]`` table each.

One style throughout: a frozen dataclass whose field docstrings are the reference of its keys;
the loader (``tables.build``) checks types and builds nested tables; ``__post_init__`` checks
the rest with ``deltarl.config.checks``. Every class has ``drain_timeout_s`` (keyword only):
how long ``drain`` (``systemctl stop``) may take before the daemon stops anyway; keep it below
the unit's ``TimeoutStopSec`` (30 s in systemd/).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from deltarl.config.checks import endpoints, positive
from deltarl.ops.exposition import parse_address
from deltarl.ops.logs import FORMATS
from deltarl.ops.placement import parse_cpu_list

DEFAULT_DRAIN_TIMEOUT_S = 25.0  # below the shortest TimeoutStopSec of the units (30 s)


@dataclass(frozen=True)
class DaemonTable:
    """What every daemon's table has."""

    control: str
    """The daemon's control endpoint (``ipc://PATH`` or ``tcp://HOST:PORT``)."""
    drain_timeout_s: float = field(default=DEFAULT_DRAIN_TIMEOUT_S, kw_only=True)
    metrics: str | None = field(default=None, kw_only=True)
    """Where the daemon serves its Prometheus metrics (``GET /metrics``): ``HOST:PORT`` or
    ``unix:/PATH``; unset, none are served. One address per daemon."""
    log_format: str = field(default="text", kw_only=True)
    """``text`` (a line per record) or ``json`` (one JSON object per line, for journald and
    log shippers; ``$DELTARL_LOG_FORMAT`` overrides it)."""
    audit_log: str | None = field(default=None, kw_only=True)
    """A file that every operator command this daemon receives is appended to, as JSON lines
    (who, which key, what, the result); they are in the daemon's log too."""
    cpus: str | None = field(default=None, kw_only=True)
    """The CPUs the daemon and every process it starts run on, as a Linux cpu list (``"0"``,
    ``"2-3"``, ``"0,4-7"``); unset, those it was started with. Set at start (a change needs a
    restart); a CPU the daemon may not use is refused then (``deltarl.ops.placement``)."""

    def __post_init__(self) -> None:
        positive(self, "drain_timeout_s")
        if self.metrics is not None:
            parse_address(self.metrics)  # ValueError names the key and says what is wanted
        if self.cpus is not None:
            parse_cpu_list(self.cpus)  # ValueError names the key and the bad item
        if self.log_format not in FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(FORMATS)}")
        endpoints(self, *(f.name for f in dataclasses.fields(self) if f.name in _ENDPOINTS))


_ENDPOINTS = ("control", "events", "apply_control", "apply_events", "scheduler")
