"""Every link's configuration, and the one registry of link types.

A ``link`` table (``[daemons.export.link]``, ``[daemons.apply.link]``, a relay's link) names
its backend with ``type``; ``LINK_CONFIGS`` maps each type to its config class, and
``deltarl.transport.base.make_sender``/``make_receiver`` map it to the backend's classes.
The configs live here, apart from their backends, so that reading a configuration imports no
backend (ucxx in particular) and no backend module imports another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SHM_ROOT = Path("/dev/shm")  # noqa: S108 - tmpfs shared memory, not a temp file


Security = Literal["auto", "on", "off"]
SECURITY = ("auto", "on", "off")


def _check_security(owner: str, value: str) -> None:
    if value not in SECURITY:
        raise ValueError(f"{owner}.security must be one of {SECURITY}, got {value!r}")


def _positive(owner: str, **values: float | None) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {value}")


@dataclass(frozen=True)
class ShmLinkConfig:
    """A same-host link through files in shared memory (shm_link.py)."""

    type: Literal["shm"] = "shm"
    name: str = "default"
    """The link's name: its directory is ``<root>/deltarl-link-<name>``. One receiver per name."""
    root: Path = SHM_ROOT
    """Where the link directory lives; tmpfs, so a chunk file is memory, not disk."""
    endpoint: str | None = None
    """The ZeroMQ notice socket; default ``ipc://<directory>/notify.sock``."""
    max_pending_chunks: int = 8
    """Chunk files this sender may have written that the receiver has not yet released. This
    bounds the shared memory a slow receiver can make the sender fill; the sender waits."""
    pending_timeout_s: float = 120.0
    """How long the sender waits for room (see ``max_pending_chunks``) before raising."""
    connect_timeout_s: float | None = 120.0
    """How long the sender waits for a receiver to be listening; None waits forever."""
    verify_checksum: bool = True
    """The receiver hashes each file (xxh3-64) against its notice: a file replaced or cut in
    shared memory is refused here rather than reported as a bad chunk by the decoder."""
    max_manifest_bytes: int = 64 << 20
    """Manifests travel inside the notice; a larger one is refused."""
    keep_versions: int = 8
    """Versions whose delivered chunk ids the receiver remembers, to drop duplicates."""

    def __post_init__(self) -> None:
        _positive(
            "ShmLinkConfig",
            max_pending_chunks=self.max_pending_chunks,
            pending_timeout_s=self.pending_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            max_manifest_bytes=self.max_manifest_bytes,
            keep_versions=self.keep_versions,
        )

    @property
    def directory(self) -> Path:
        return Path(self.root) / f"deltarl-link-{self.name}"


@dataclass(frozen=True)
class StreamLinkConfig:
    """A cross-region link over parallel TCP connections with acks and resume (stream.py)."""

    type: Literal["stream"] = "stream"
    host: str = "127.0.0.1"
    """The receiver's address: where it listens, and where the sender connects."""
    port: int = 0
    """The receiver's port; 0 lets the receiver pick one (read it back from ``address``)."""
    connections: int = 4
    """Parallel TCP connections; chunks go round-robin. One stream rarely fills a long, fat
    pipe (its window grows slowly after a loss), several together do."""
    compress: bool = True
    """zstd each payload, keeping the result only when it is smaller."""
    compression_level: int = 3
    window_bytes: int = 512 << 20
    """Payload bytes sent but not yet acknowledged, at most; ``send_chunk`` waits for room.
    The sender keeps exactly these bytes to resend after a cut, so this bounds its memory."""
    max_frame_bytes: int = 256 << 20
    """The largest payload a peer accepts (after decompression too); larger frames are refused."""
    ack_timeout_s: float = 120.0
    """A connection with unacknowledged frames that hears nothing for this long is treated as
    cut. A receiver whose consumer stalls this long looks the same, and is reconnected."""
    connect_timeout_s: float = 10.0
    max_attempts: int = 8
    """Connection attempts in a row without an acknowledgement before the sender gives up."""
    backoff_s: float = 0.1
    """The first retry's delay; it doubles per attempt, with jitter, up to ``backoff_max_s``."""
    backoff_max_s: float = 5.0
    queue_size: int = 16
    """Received items waiting for the consumer; when full, the receiver stops reading its
    sockets, and TCP's flow control slows the sender."""
    keep_versions: int = 8
    """Versions whose delivered chunk ids the receiver remembers (for dedup and resume)."""
    max_connections: int = 64
    """Connections the receiver serves at once; it closes any more at once (logged)."""
    max_connections_per_peer: int = 16
    """Connections the receiver serves at once from one peer address (its IP); the sender's
    ``connections`` must fit, with room for those of a sender that restarted."""
    memory_budget_bytes: int | None = None
    """Payload bytes the receiver holds at once, over all its connections: each payload's
    bytes (compressed and decompressed) are reserved before it is read, and given back when
    the consumer releases the chunk (a manifest: when the consumer takes it). A payload that
    does not fit waits, which stops reading that connection (TCP slows its sender). At least
    ``2 * max_frame_bytes`` (one largest frame, compressed and decompressed at once); None,
    the default, is exactly that."""

    security: Security = "auto"
    """TLS 1.3 with mutual authentication (deltarl/transport/data_keys.py). ``auto``: on
    whenever ``DELTARL_CURVE_KEYS`` is set, and refused without it unless ``host`` is
    loopback; ``on``: required; ``off``: never (a network trusted otherwise). Manifests are
    sealed whenever the keys are set, whatever this says."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"StreamLinkConfig.port must lie in [0, 65535], got {self.port}")
        _check_security("StreamLinkConfig", self.security)
        if not 1 <= self.compression_level <= 22:
            raise ValueError(
                f"StreamLinkConfig.compression_level must lie in [1, 22], "
                f"got {self.compression_level}"
            )
        _positive(
            "StreamLinkConfig",
            connections=self.connections,
            window_bytes=self.window_bytes,
            max_frame_bytes=self.max_frame_bytes,
            ack_timeout_s=self.ack_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            max_attempts=self.max_attempts,
            backoff_s=self.backoff_s,
            backoff_max_s=self.backoff_max_s,
            queue_size=self.queue_size,
            keep_versions=self.keep_versions,
            max_connections=self.max_connections,
            max_connections_per_peer=self.max_connections_per_peer,
        )
        if self.memory_budget_bytes is not None and (
            self.memory_budget_bytes < 2 * self.max_frame_bytes
        ):
            raise ValueError(
                f"StreamLinkConfig.memory_budget_bytes must be at least 2 * max_frame_bytes "
                f"({2 * self.max_frame_bytes}), got {self.memory_budget_bytes}"
            )
        if self.max_connections_per_peer > self.max_connections:
            raise ValueError(
                f"StreamLinkConfig.max_connections_per_peer ({self.max_connections_per_peer}) "
                f"must not exceed max_connections ({self.max_connections})"
            )
        if self.connections > self.max_connections_per_peer:
            raise ValueError(
                f"StreamLinkConfig.connections ({self.connections}) must not exceed "
                f"max_connections_per_peer ({self.max_connections_per_peer}): the receiver "
                f"would refuse the rest"
            )

    @property
    def budget_bytes(self) -> int:
        """The receiver's memory budget: ``memory_budget_bytes``, or 2 * ``max_frame_bytes``."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        return 2 * self.max_frame_bytes


@dataclass(frozen=True)
class UcxLinkConfig:
    """An intra-region link over UCX: RDMA where present, else tcp and shared memory."""

    type: Literal["ucx"] = "ucx"
    host: str = "127.0.0.1"
    """Where the sender connects. The receiver listens on every interface: ucxx's listener
    takes a port only."""
    port: int = 0
    """The receiver's port; 0 lets UCX pick one (read it back from ``address``)."""
    connect_timeout_s: float = 10.0
    """One connection attempt, UCX's handshake included."""
    max_attempts: int = 8
    """Connection attempts in a row before the sender gives up with LinkError."""
    backoff_s: float = 0.1
    """The first retry's delay; it doubles per attempt, up to ``backoff_max_s``."""
    backoff_max_s: float = 5.0
    ack_timeout_s: float = 120.0
    """The longest a send may block, and the longest ``send_manifest`` waits without hearing an
    acknowledgement. A receiver whose consumer stalls this long looks the same as a dead one."""
    max_frame_bytes: int = 1 << 30
    """The largest payload the receiver accepts; a header announcing more drops the
    connection before anything is allocated."""
    queue_size: int = 16
    """Received items waiting for the consumer; when full, the receiver stops pulling
    payloads, and the sender's sends wait."""
    keep_versions: int = 8
    """Versions whose delivered chunk ids the receiver remembers, to drop duplicates."""

    security: Security = "auto"
    """UCX carries no TLS: what authenticates its versions is the manifest's seal, checked by
    the apply agent whenever ``DELTARL_CURVE_KEYS`` is set. ``auto``: a sender to a host that
    is not loopback refuses to start without the keys; ``on``: keys required; ``off``: never
    required (a network trusted otherwise)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"UcxLinkConfig.port must lie in [0, 65535], got {self.port}")
        _check_security("UcxLinkConfig", self.security)
        _positive(
            "UcxLinkConfig",
            connect_timeout_s=self.connect_timeout_s,
            max_attempts=self.max_attempts,
            backoff_s=self.backoff_s,
            backoff_max_s=self.backoff_max_s,
            ack_timeout_s=self.ack_timeout_s,
            max_frame_bytes=self.max_frame_bytes,
            queue_size=self.queue_size,
            keep_versions=self.keep_versions,
        )


LinkConfig = ShmLinkConfig | StreamLinkConfig | UcxLinkConfig

LINK_CONFIGS: dict[str, type[LinkConfig]] = {
    "shm": ShmLinkConfig,
    "stream": StreamLinkConfig,
    "ucx": UcxLinkConfig,
}
"""Link type -> its config class (the backend classes: ``deltarl.transport.base``)."""
