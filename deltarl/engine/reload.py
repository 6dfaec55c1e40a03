"""``systemctl reload`` (SIGHUP): read the daemon's table again and take what can change live.

The daemon's table is loaded again (a table that no longer loads changes nothing, and says
why). Of the keys whose value changed:

- the runtime's own: ``log_format`` and ``audit_log`` (the log handlers are set again);
- the core's ``reloadable`` keys (``DaemonCore.reloadable``): the core's ``config`` becomes
  the old one with those values replaced. A core lists only keys it reads from
  ``self.config`` when it uses them, never ones it copied into objects at start;
- any other key: logged as needing a restart, and left as it was (the running daemon keeps
  the configuration it started with, apart from the keys above).

Every reload is logged with what it applied and what it did not, so ``journalctl -u`` says
whether a change took effect.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from deltarl.config.errors import ConfigError
from deltarl.ops import logs

logger = logging.getLogger(__name__)

RUNTIME_RELOADABLE = frozenset({"log_format", "audit_log"})


@dataclasses.dataclass(frozen=True)
class Reloaded:
    applied: tuple[str, ...]
    needs_restart: tuple[str, ...]
    error: str | None = None


def changed_keys(old: Any, new: Any) -> list[str]:  # noqa: ANN401 - two config dataclasses
    return [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]


def reload_core(
    core: Any,  # noqa: ANN401 - a DaemonCore with a ``config``
    daemon: str,
    name: str,
    read: Callable[[], Any],
) -> Reloaded:
    """Read the table again (``read``) and apply what may change to ``core``."""
    old = getattr(core, "config", None)
    if old is None or not dataclasses.is_dataclass(old):
        return Reloaded((), (), "this daemon's core keeps no configuration to reload")
    try:
        new = read()
    except ConfigError as e:
        logger.warning("%s: reload refused, the configuration is unchanged: %s", name, e)
        return Reloaded((), (), str(e))
    changed = changed_keys(old, new)
    live = [k for k in changed if k in core.reloadable]
    runtime = [k for k in changed if k in RUNTIME_RELOADABLE]
    restart = tuple(k for k in changed if k not in live and k not in runtime)
    if live:
        core.config = dataclasses.replace(old, **{k: getattr(new, k) for k in live})
    if runtime:
        logs.configure(daemon, name, new.log_format, new.audit_log)
    applied = tuple(live + runtime)
    logger.info(
        "%s: reloaded: %s; needs a restart: %s",
        name,
        ", ".join(applied) or "nothing changed that can change live",
        ", ".join(restart) or "nothing",
    )
    return Reloaded(applied, restart)
