"""``deltarl apply --config FILE [--name apply-b]``: the apply agent's process.

The core is ``deltarl.refit.apply.ApplyCore`` (receive, apply, verify, flip; the state it
publishes); this module wires it: the rollout store (attached, or created with the layout of
``layout_store`` or ``layout_file``), the link's receiver, and for a relay the children's
senders and a ``ReceiverWatch`` per child. Control: ``status``, ``resync``, ``rollback``,
``drain``, ``shutdown``, and ``refit.get_receiver`` for the export agent.
"""

from __future__ import annotations

import asyncio
import errno
import time

from deltarl.codecs.kernel_warmth import start_warming
from deltarl.config import ConfigError
from deltarl.config.refit import ApplyConfig
from deltarl.daemons.process import daemon_main
from deltarl.engine.daemon import DaemonContext
from deltarl.engine.layout import Layout
from deltarl.engine.weight_store import WeightStore
from deltarl.ops.kernel_threads import quiet_kernel_threads
from deltarl.refit.apply import ApplyCore
from deltarl.refit.receiver_state import StateFeed
from deltarl.refit.relay import Relay
from deltarl.transport.base import make_receiver, make_sender
from deltarl.transport.data_keys import DataKeys
from deltarl.transport.receiver_watch import ReceiverWatch


async def _layout(cfg: ApplyConfig) -> Layout:
    if cfg.layout_file is not None:
        return Layout.from_json(cfg.layout_file.read_bytes())
    if cfg.layout_store is None:
        raise ConfigError(
            f"rollout store {cfg.rollout_store!r} does not exist and neither layout_file "
            f"nor layout_store says how to create it"
        )
    deadline = time.monotonic() + cfg.layout_wait_s
    while True:
        try:
            with WeightStore.open(cfg.layout_store, root=cfg.store_root, readonly=True) as src:
                return src.layout
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def open_rollout_store(cfg: ApplyConfig) -> WeightStore:
    """The rollout store: attach if it exists (it outlives a restart), else create it."""
    try:
        return WeightStore.open(cfg.rollout_store, root=cfg.store_root)
    except FileNotFoundError:
        pass
    layout = await _layout(cfg)
    try:
        return WeightStore.create(cfg.rollout_store, layout, root=cfg.store_root)
    except FileExistsError:
        return WeightStore.open(cfg.rollout_store, root=cfg.store_root, layout=layout)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        # A store that does not fit is a capacity setting (store_root, the tmpfs size), not
        # a crash to restart in a loop: exit 78, which the units do not restart on.
        raise ConfigError(f"{e.strerror}; free space there or set store_root") from None


async def _build(cfg: ApplyConfig, context: DaemonContext) -> ApplyCore:
    store = await open_rollout_store(cfg)
    feeds = tuple((target, StateFeed()) for target in cfg.relay)
    relay = Relay(feeds, make_sender)
    for target, feed in feeds:
        watch = ReceiverWatch(feed, target.control, target.events, on_update=relay.heard)
        watch.start()
        context.on_close(watch.close)
    keys = DataKeys.from_env()  # the manifest MAC key, with the control plane's CURVE keys
    mac_key = None if keys is None else keys.mac_key
    core = ApplyCore(cfg, context, store, make_receiver(cfg.link), relay, mac_key)
    core.kernels, _ = start_warming(context.name)  # codecs/kernel_warmth.py
    return core


def main(argv: list[str]) -> int:
    quiet_kernel_threads()  # before the first decode kernel (deltarl/ops/kernel_threads.py)
    return daemon_main("apply", ApplyConfig, argv, _build, __doc__ or "")
