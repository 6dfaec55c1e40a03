"""Daemon logs: plain text for a terminal, or one JSON object per line for journald and log
shippers; and the audit log of operator commands.

``log_format = "json"`` in a daemon's table (or ``DELTARL_LOG_FORMAT=json`` in its
environment, which wins: a unit can switch without editing the file) makes every record

    {"ts": 1796241846.12, "level": "INFO", "daemon": "apply", "name": "apply-b",
     "logger": "deltarl.refit.apply", "msg": "version 7 active (base 6, 0.112 s)",
     "version": 7}

with the context fields a record carries (``extra=``): ``version``, ``step``, ``request_id``,
and for audit records ``command``, ``peer``, ``result``. A traceback goes in ``exc``, never
across lines (a multi-line record breaks line-based shippers).

The audit log: the control server (deltarl/transport/control.py) logs every command that
changes what a daemon does to the ``deltarl.audit`` logger, with who sent it (the CURVE key it
authenticated with, or how the socket is reached) and what came of it. Those records go to the
daemon's log like any other, and, with ``audit_log = PATH`` in its table, also to that file,
always as JSON lines, appended and flushed per record.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson

AUDIT_LOGGER = "deltarl.audit"
FORMATS = ("text", "json")
FORMAT_ENV = "DELTARL_LOG_FORMAT"
CONTEXT_FIELDS = ("version", "step", "request_id", "command", "peer", "result", "reason")


class JsonFormatter(logging.Formatter):
    def __init__(self, daemon: str, name: str) -> None:
        super().__init__()
        self.daemon, self.name = daemon, name

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "daemon": self.daemon,
            "name": self.name,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in CONTEXT_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure(daemon: str, name: str, fmt: str = "text", audit_log: str | None = None) -> None:
    """Set the root logger's one handler (stderr) to ``fmt`` and, with ``audit_log``, add the
    audit file. ValueError for an unknown format."""
    fmt = os.environ.get(FORMAT_ENV) or fmt
    if fmt not in FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setFormatter(
            JsonFormatter(daemon, name)
            if fmt == "json"
            else logging.Formatter(f"%(asctime)s {name} %(levelname)s %(message)s")
        )
    audit_logger = logging.getLogger(AUDIT_LOGGER)
    for old in [h for h in audit_logger.handlers if getattr(h, "deltarl_audit_file", False)]:
        audit_logger.removeHandler(old)  # a reload: the file may have moved
        old.close()
    if audit_log is not None:
        audit = logging.FileHandler(audit_log, encoding="utf-8")  # appends; flushes per record
        audit.setFormatter(JsonFormatter(daemon, name))
        audit.deltarl_audit_file = True  # type: ignore[attr-defined]
        audit_logger.addHandler(audit)
