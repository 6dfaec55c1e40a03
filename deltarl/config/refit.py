"""The refit path's tables: ``[daemons.trainer]`` of the synthetic trainer, ``export``,
``apply`` and its ``[[daemons.apply.relay]]`` targets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from deltarl.config.base import DaemonTable
from deltarl.config.checks import at_least, endpoints, non_negative, positive
from deltarl.transport.link_config import LinkConfig


@dataclass(frozen=True)
class TrainerConfig(DaemonTable):
    """``deltarl trainer --synthetic``: publishes a synthetic model's versions."""

    control: str
    """The trainer's control endpoint (ROUTER)."""
    published_store: str
    """The weight store it creates and commits every version into (the version counter)."""
    store_root: Path | None = None
    """Directory of the weight stores; None: /dev/shm."""
    params: int = 200_000
    """Parameters of the synthetic model (RealisticDeltas)."""
    interval_s: float = 1.0
    """Seconds between optimizer steps (each one publishes a version)."""
    steps: int = 0
    """Stop stepping after this many steps (keep serving); 0: never stop."""
    seed: int = 0
    tensor_digests: bool = True
    """Commit each tensor's digest with every version, as the trainer's publisher does
    (deltarl/trainer/publisher.py): the export agent sends them instead of hashing the model.
    False: it commits none, and the export agent hashes (``bench refit --compare-export-hash``
    measures the difference)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "params", "interval_s")
        non_negative(self, "steps")


@dataclass(frozen=True)
class ExportConfig(DaemonTable):
    control: str
    published_store: str
    """The trainer's store: the export agent is its only reader."""
    manifest_store: Path
    """The sqlite record of every version (deltarl.refit.manifest_store)."""
    apply_control: str
    """The apply agent's control endpoint: asked for its receiver state when the export agent
    starts, and whenever its events fall silent."""
    link: LinkConfig
    apply_events: str | None = None
    """The apply agent's event endpoint: its receiver state (acknowledgements, failures,
    restarts) arrives there as it changes, and as a heartbeat. None: the state is asked of
    ``apply_control`` every ``poll_s`` instead, which adds up to ``poll_s`` to every refit."""
    events: str | None = None
    """Where VersionPublished / RefitFailed are published; None: not published."""
    store_root: Path | None = None
    full_resync_every: int = 50
    """A full version after this many deltas in a row, to bound every delta chain: the
    ceiling of the period (``full_resync_overhead`` may shorten it)."""
    full_resync_overhead: float = 0.05
    """The adaptive period: a periodic full version may cost this share of the wire bytes
    that deltas take, so the period is the number of deltas whose bytes make a full version
    worth sending: ceil(full bytes / (overhead x mean delta bytes)), measured on this run's
    versions, at most ``full_resync_every``. Small deltas (a low changed ratio) keep the
    ceiling; deltas near a full version's size resync more often, as it costs little more.
    0 turns it off (the fixed period)."""
    chunk_bytes: int = 16 << 20
    """Input bytes per encoded chunk. Measured on 98M params (bench refit, 1 Gbit): 4 MiB chunks
    spent more on per-chunk overhead than they gained in overlap (median delta 0.22-0.30 s),
    16 MiB 0.15-0.20 s, 32 MiB 0.14-0.16 s with less overlap (total 1.3-1.5x its slowest
    stage); 16 MiB is the compromise."""
    delta_coding: Literal["rice", "conditioned", "conditioned_rice", "conditioned_huffman"] = "rice"
    """How deltas' sparse ranges are coded. ``rice``: positions and values Golomb-Rice coded,
    touching only the changed elements. ``conditioned``: float ranges also range-coded against
    the reference's exponents (deltarl/codecs/conditioned.py), each kept where smaller.
    Measured with ``deltarl bench codec`` on a 2-core machine: 0.63-0.70x the wire bytes of
    ``rice`` on simulated AdamW deltas (98M parameters), 0.23-0.43x on SmolLM2-135M's real
    GRPO deltas; encode about 2.5-3x and apply about 4-5x slower (a pass over every element
    of a changed range on both sides, and a range coder). Worth it where the link, not the
    CPU, is the slowest stage of a refit (cross-region links; ``deltarl bench refit
    --compare-conditioned --rate-mbit R`` measures it). The apply agents need nothing set
    (each record names its coding), but must run a deltarl that reads it: an older one
    refuses the version (unknown position coding 4). ``conditioned_rice``: the same split by
    the reference's exponents, coded with Rice codes instead of the range coder
    (deltarl/codecs/conditioned_rice.py): on simulated AdamW deltas 0.80x the bytes of
    ``rice`` against ``conditioned``'s 0.68-0.73x, the export agent's encode 1.4-1.5x and
    the apply 1.7-2x as fast as ``conditioned``'s (still several times slower than
    ``rice``: both sides walk the reference). An apply agent older than it refuses the
    version ("conditioned record with model 2"). ``conditioned_huffman``: the same with each
    exponent's values coded by a Rice or a Huffman code of its own, and exponents with more
    changed elements than not coded by their unchanged ones
    (deltarl/codecs/conditioned_huffman.py): on simulated AdamW deltas 0.67-0.73x the bytes
    of ``rice``, as small as ``conditioned``, at ``conditioned_rice``'s apply speed and
    nearly its encode speed; on real GRPO deltas 1.05-1.13x ``conditioned``'s bytes. The
    choice where the link is slow and the CPU matters too. An apply agent older than it
    refuses the version ("conditioned record with model 3")."""
    value_classes: bool = True
    """Rice code the changed values of bf16, fp16 and fp32 ranges with a parameter per
    exponent of the reference element where that is smaller (docs/architecture.md, "Values
    by class"): 6-8% fewer wire bytes on simulated AdamW deltas and 12-16% on real GRPO deltas,
    for an apply 5-17% slower (timed in alternating rounds against one parameter a record). A
    deltarl older than it refuses such versions (unknown value coding 4): in a fleet that
    upgrades its apply agents after the export agent, set it false until they are done."""
    ack_timeout_s: float = 60.0
    """How long to wait for the apply agent to report a sent version active or failed."""
    poll_s: float = 0.05
    """How often the published store's version is checked (and, without ``apply_events``, the
    receiver's state)."""
    keep_versions: int = 1000
    """Versions the manifest store keeps (the newest ones; older superseded and failed ones are
    pruned after each send). The active version, versions in flight, the last full version and
    the reference are kept whatever their age (deltarl/refit/manifest_store.py), so 1 is safe;
    more is history for operators."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "full_resync_every", "chunk_bytes", "ack_timeout_s", "poll_s")
        non_negative(self, "full_resync_overhead")
        at_least(self, 1, "keep_versions")


@dataclass(frozen=True)
class RelayTarget:
    """One apply agent this one relays to (``[[daemons.apply.relay]]``)."""

    control: str
    """The child's control endpoint: asked for its receiver state."""
    link: LinkConfig
    """How the chunks reach it (its receiver's link config)."""
    events: str | None = None
    """The child's event endpoint: its receiver state arrives there as it changes."""
    name: str = ""
    """For status and logs; default: the control endpoint."""
    max_queued_bytes: int = 256 << 20
    """Relayed bytes waiting for this child at most (see deltarl/refit/relay.py)."""

    def __post_init__(self) -> None:
        endpoints(self, "control", "events")
        positive(self, "max_queued_bytes")

    @property
    def label(self) -> str:
        return self.name or self.control


@dataclass(frozen=True)
class ApplyConfig(DaemonTable):
    control: str
    rollout_store: str
    """The double-buffered store the apply agent writes (created if it does not exist)."""
    link: LinkConfig
    events: str | None = None
    """Where the receiver state (and VersionApplied / RefitFailed) is published: the export
    agent's ``apply_events``."""
    heartbeat_s: float = 1.0
    """The receiver state is published at least this often, so a silent agent is noticed."""
    store_root: Path | None = None
    layout_store: str | None = None
    """A store on this host whose layout the rollout store copies when it must be created."""
    layout_file: Path | None = None
    """Or a file holding ``Layout.to_json()``."""
    layout_wait_s: float = 120.0
    """How long to wait for ``layout_store`` to appear (the trainer creates it)."""
    relay: tuple[RelayTarget, ...] = ()
    """Further apply agents this one relays every chunk to (``[[daemons.apply.relay]]``
    tables); see deltarl/refit/relay.py."""
    lease_bound_s: float = 10.0
    """The longest a version waits for readers (engines loading) still leasing the buffer it
    must be written into; past it their leases are revoked, and each reader learns it and
    loads again (weight_store.py, I4). Never a wait on the slowest reader without end."""
    stalled_job_s: float = 30.0
    """A version being applied that has received nothing for this long no longer makes older
    versions wait: they may replace it. A version is proven only by its manifest, which comes
    last, so until then its chunks are unproven (forged, or from a sender that died); without
    this bound they would hold off every older real version for good."""
    catch_up: Literal["eager", "on_open", "off"] = "eager"
    """How the inactive buffer comes to hold a delta's base (deltarl/refit/catch_up.py):
    ``eager``, by the last delta again right after each commit (off the refit's path; a
    rollback then writes an undo back and verifies it); ``on_open``, the same when the next
    delta opens; ``off``, a copy of the whole active buffer (what ``deltarl bench refit
    --compare-copy`` measures against)."""
    catch_up_max_bytes: int = 2 << 30
    """The most memory a kept delta may hold (16 bytes a changed element); a larger one is
    not kept, and the next delta copies."""

    def __post_init__(self) -> None:
        super().__post_init__()
        positive(self, "heartbeat_s", "layout_wait_s", "stalled_job_s", "lease_bound_s")
        positive(self, "catch_up_max_bytes")
