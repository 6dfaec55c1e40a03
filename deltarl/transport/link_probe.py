"""Measure a stream link: bandwidth, round-trip time and loss, with the link's own protocol.

``deltarl doctor`` opens one connection to a stream receiver (an apply agent's, running), as
the export agent would (TLS with the cluster's keys where the link has them), and for
``seconds`` keeps ``window`` PROBE messages of ``payload_bytes`` in flight; the receiver reads
each one, throws it away and answers PROBE_ACK (deltarl/transport/stream_wire.py). Nothing is
delivered, so a running pipeline is not disturbed beyond the bandwidth used.

Figures: ``mbit_s`` (bytes acknowledged over the time, so the receiver's side is counted),
``rtt_ms`` (the kernel's smoothed RTT of the connection, ``TCP_INFO``), and ``retrans_ratio``
(segments retransmitted over segments sent on that connection: what the link lost, as TCP
saw it). One connection measures what one TCP flow gets; the export agent may use several.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from deltarl.transport.data_keys import link_keys
from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.stream_wire import MSG_PROBE, TO_PROBER, pack_header, read_message

# struct tcp_info (linux/tcp.h): 8 one-byte fields, then u32s; the offsets read here.
_RTT_US = struct.Struct("=I")  # tcpi_rtt, u32 at byte 68
_TOTAL_RETRANS = 100  # tcpi_total_retrans, u32
_SEGS_OUT = 136  # tcpi_segs_out, u32 (after four u64 fields; Linux 4.2 and newer)
_TCP_INFO_BYTES = 232


@dataclass(frozen=True)
class LinkFigures:
    peer: str
    seconds: float
    bytes_acked: int
    mbit_s: float
    rtt_ms: float | None
    retrans_ratio: float | None


def _tcp_info(sock: socket.socket | None) -> tuple[float | None, int | None, int | None]:
    """(rtt ms, total retransmitted segments, segments sent), or Nones off Linux."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None, None, None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None, None, None
    if len(raw) < _SEGS_OUT + 4:
        return None, None, None
    rtt = _RTT_US.unpack_from(raw, 68)[0] / 1000
    retrans = struct.unpack_from("=I", raw, _TOTAL_RETRANS)[0]
    segs = struct.unpack_from("=I", raw, _SEGS_OUT)[0]
    return rtt, retrans, segs


async def probe(
    config: StreamLinkConfig,
    seconds: float = 3.0,
    payload_bytes: int = 1 << 20,
    window: int = 8,
    clock: Callable[[], float] = time.monotonic,
) -> LinkFigures:
    """Measure the link to ``config.host:config.port``; OSError if it cannot connect."""
    payload_bytes = min(payload_bytes, config.max_frame_bytes)
    keys = link_keys("link probe", config.host, config.security)
    tls = None if keys is None else keys.client_context()
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            config.host, config.port, ssl=tls, server_hostname=config.host if tls else None
        ),
        config.connect_timeout_s,
    )
    sock = writer.get_extra_info("socket")
    message = pack_header(MSG_PROBE, 0, 0, payload_bytes) + bytes(payload_bytes)
    acked = 0
    try:
        started = clock()
        deadline = started + seconds
        in_flight = 0
        sent = 0
        while True:
            while in_flight < window and clock() < deadline:
                writer.write(message)
                sent += 1
                in_flight += 1
            await writer.drain()
            if in_flight == 0:
                break
            reply = await asyncio.wait_for(read_message(reader, TO_PROBER, 0), config.ack_timeout_s)
            if reply is None:
                raise ConnectionError("the receiver closed the connection")
            in_flight -= 1
            acked += payload_bytes
        elapsed = clock() - started
        rtt, retrans, segs = _tcp_info(sock)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return LinkFigures(
        peer=f"{config.host}:{config.port}",
        seconds=round(elapsed, 3),
        bytes_acked=acked,
        mbit_s=round(acked * 8 / elapsed / 1e6, 3) if elapsed > 0 else 0.0,
        rtt_ms=None if rtt is None else round(rtt, 3),
        retrans_ratio=None if not segs or retrans is None else round(retrans / segs, 6),
    )
