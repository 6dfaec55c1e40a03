"""``deltarl export --config FILE``: the export agent's process.

The core is ``deltarl.refit.export.ExportCore`` (the reference, the acknowledgement, drain);
this module wires it: the link's sender, the manifest store, and a ``ReceiverWatch`` that
keeps the core's ``StateFeed`` current from the apply agent's events (``apply_events``) and
control socket (``apply_control``). Control: ``status``, ``pause``, ``resume``, ``resync``,
``drain``, ``shutdown``; ``versions`` (the manifest store's history: ``deltarl ctl export
versions``) and ``deltas`` (``deltarl ctl export deltas off|on``: full versions only until
turned back on, kept across restarts).
"""

from __future__ import annotations

from functools import partial

from deltarl.codecs.kernel_warmth import start_warming
from deltarl.config.refit import ExportConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.ops.kernel_threads import quiet_kernel_threads
from deltarl.refit.export import ExportCore
from deltarl.refit.manifest_store import ManifestStore
from deltarl.refit.receiver_state import StateFeed
from deltarl.transport.base import make_sender
from deltarl.transport.data_keys import DataKeys
from deltarl.transport.receiver_watch import ReceiverWatch


async def _build(cfg: ExportConfig, context: DaemonContext) -> ExportCore:
    feed = StateFeed()
    watch = ReceiverWatch(feed, cfg.apply_control, cfg.apply_events, poll_s=cfg.poll_s)
    watch.start()
    context.on_close(watch.close)
    senders = partial(make_sender, cfg.link)
    keys = DataKeys.from_env()  # the manifest MAC key, with the control plane's CURVE keys
    mac_key = None if keys is None else keys.mac_key
    core = ExportCore(cfg, context, feed, senders, ManifestStore(cfg.manifest_store), mac_key)
    core.kernels, _ = start_warming(context.name)  # codecs/kernel_warmth.py
    return core


def main(argv: list[str]) -> int:
    quiet_kernel_threads()  # before the first encode kernel (deltarl/ops/kernel_threads.py)
    return daemon_main("export", ExportConfig, argv, _build, __doc__ or "")
