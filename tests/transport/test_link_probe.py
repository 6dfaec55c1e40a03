"""The stream link's PROBE (deltarl/transport/link_probe.py): against a real receiver on
loopback (bytes thrown away, nothing delivered), and across two network namespaces joined by
a tbf-shaped veth pair, where it must measure the rate the test set."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest
from deltarl.bench import netns

from deltarl.transport.link_config import StreamLinkConfig
from deltarl.transport.link_probe import probe
from deltarl.transport.stream_receiver import StreamReceiver


def test_probe_on_loopback_delivers_nothing_and_counts_what_arrived() -> None:
    async def scenario() -> None:
        receiver = StreamReceiver(StreamLinkConfig(host="127.0.0.1", port=0))
        await receiver.start()
        try:
            host, port = receiver.address
            figures = await probe(
                StreamLinkConfig(host=host, port=port), seconds=0.5, payload_bytes=256 << 10
            )
            assert figures.bytes_acked > 0
            assert figures.bytes_acked % (256 << 10) == 0
            assert receiver.stats.probe_bytes == figures.bytes_acked
            assert receiver.stats.delivered == 0  # thrown away, never queued for the agent
            assert figures.mbit_s > 0
            assert figures.rtt_ms is not None
            assert figures.retrans_ratio is not None
            assert figures.retrans_ratio < 0.01
        finally:
            await receiver.close()

    asyncio.run(scenario())


def test_probe_to_nothing_fails_to_connect() -> None:
    async def scenario() -> None:
        receiver = StreamReceiver(StreamLinkConfig(host="127.0.0.1", port=0))
        await receiver.start()
        host, port = receiver.address
        await receiver.close()  # the port is free again: nobody listens
        with pytest.raises(OSError):
            await probe(StreamLinkConfig(host=host, port=port, connect_timeout_s=2), seconds=0.2)

    asyncio.run(scenario())


RECEIVER = textwrap.dedent(
    """
    import asyncio, sys
    from deltarl.transport.link_config import StreamLinkConfig
    from deltarl.transport.stream_receiver import StreamReceiver

    async def main():
        r = StreamReceiver(StreamLinkConfig(host=sys.argv[1], port=int(sys.argv[2]),
                                            security="off"))
        await r.start()
        print("listening", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
    """
)
PROBER = textwrap.dedent(
    """
    import asyncio, dataclasses, sys, orjson
    from deltarl.transport.link_config import StreamLinkConfig
    from deltarl.transport.link_probe import probe

    cfg = StreamLinkConfig(host=sys.argv[1], port=int(sys.argv[2]), security="off")
    print(orjson.dumps(dataclasses.asdict(asyncio.run(probe(cfg, seconds=4.0)))).decode())
    """
)


def test_probe_measures_a_shaped_link_between_two_namespaces(tmp_path: Path) -> None:
    why = netns.check_privilege()
    if why is not None:
        pytest.skip(f"shaping needs network namespaces: {why}")
    (tmp_path / "receiver.py").write_text(RECEIVER)
    (tmp_path / "prober.py").write_text(PROBER)
    rate = 40.0
    with netns.ShapedLink(rate) as link:
        receiver = subprocess.Popen(
            [*link.exec_prefix("b"), sys.executable, str(tmp_path / "receiver.py"),
             link.addr_b, "7401"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert receiver.stdout is not None
            assert receiver.stdout.readline().strip() == "listening"
            time.sleep(0.2)
            done = subprocess.run(
                [*link.exec_prefix("a"), sys.executable, str(tmp_path / "prober.py"),
                 link.addr_b, "7401"],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            figures = orjson.loads(done.stdout)
        finally:
            receiver.terminate()
            receiver.wait(30)
    # The tbf rate is the ceiling; one TCP flow gets most of it.
    assert 0.6 * rate <= figures["mbit_s"] <= 1.05 * rate, figures
    assert figures["rtt_ms"] is not None
