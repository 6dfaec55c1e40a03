"""The `deltarl bench codec --json` contract: one JSON object with exactly these keys."""

import math
import subprocess
import sys

import orjson

STEP_KEYS = {
    "step": int,
    "changed_ratio": float,
    "full_bytes": int,
    "wire_bytes": int,
    "bytes_per_change": float,
    "entropy_bytes_per_change": float,
    "entropy_ordered_bytes_per_change": float,
    "entropy_conditioned_bytes_per_change": float,
    "encode_gbps": float,
    "encode_trainer_digests_gbps": float,
    "apply_gbps": float,
    "apply_two_buffers_gbps": float,
    "writes_gbps": float,
    "verify_gbps": float,
    "classed_rice_bytes_per_change": float,
    "bit_exact": bool,
    "conditioned": dict,
    "conditioned_rice": dict,
    "conditioned_huffman": dict,
    "one_value_parameter": dict,
}
ONE_PARAMETER_KEYS = {
    "wire_bytes": int,
    "bytes_per_change": float,
    "encode_gbps": float,
    "apply_gbps": float,
    "bit_exact": bool,
}
CONDITIONED_KEYS = {
    "wire_bytes": int,
    "bytes_per_change": float,
    "vs_ordered_bound": float,
    "encode_gbps": float,
    "apply_gbps": float,
    "bit_exact": bool,
    "walk_gbps": float,
}


def test_bench_codec_json_shape_and_bit_exactness():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "bench",
            "codec",
            "--params",
            "300000",
            "--steps",
            "2",
            "--repeat",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1, out.stdout
    result = orjson.loads(lines[0])
    assert set(result) == {"params", "memcpy_gbps", "steps"}
    assert isinstance(result["params"], int)
    assert result["params"] > 200_000
    assert isinstance(result["memcpy_gbps"], float)
    assert result["memcpy_gbps"] > 0
    assert [s["step"] for s in result["steps"]] == [1, 2]
    for s in result["steps"]:
        assert set(s) == set(STEP_KEYS)
        for key, kind in STEP_KEYS.items():
            assert isinstance(s[key], kind), (key, s[key])
        assert s["bit_exact"] is True  # also the writes timed alone (they must give cur too)
        # the apply's parts besides decoding, each timed alone: real, finite rates
        assert 0 < s["writes_gbps"] < math.inf
        assert 0 < s["verify_gbps"] < math.inf
        assert 0.0 < s["changed_ratio"] < 1.0
        assert 0 < s["wire_bytes"] < s["full_bytes"]
        assert s["entropy_bytes_per_change"] > 0
        # The ordered delta's symbols cost less than the XOR's, and conditioning on what both
        # sides hold costs less again (on AdamW deltas; not a law for every delta).
        assert 0 < s["entropy_ordered_bytes_per_change"] < s["entropy_bytes_per_change"]
        assert 0 < s["entropy_conditioned_bytes_per_change"] < s["entropy_ordered_bytes_per_change"]
        # the conditioned codings (the range coder, Rice, and a value code per exponent)
        for c in (s["conditioned"], s["conditioned_rice"], s["conditioned_huffman"]):
            assert set(c) == set(CONDITIONED_KEYS)
            for key, kind in CONDITIONED_KEYS.items():
                assert isinstance(c[key], kind), (key, c[key])
            # coded against the reference it is bit-exact too; a range keeps it only where it
            # is smaller, so the wire grows by a stream-table entry (24 B a chunk) at worst.
            # (On tensors this small the coding's own overhead eats the gain;
            # test_conditioned*.py and the benchmark at full size measure the gain.)
            assert c["bit_exact"] is True
            assert 0 < c["walk_gbps"] < math.inf  # its floor, timed: a real, finite rate
            assert 0 < c["wire_bytes"] <= s["wire_bytes"] + 24
            ordered = s["entropy_ordered_bytes_per_change"]
            assert c["vs_ordered_bound"] == c["bytes_per_change"] / ordered
        assert s["conditioned_rice"]["walk_gbps"] == s["conditioned"]["walk_gbps"]
        assert s["conditioned_huffman"]["walk_gbps"] == s["conditioned"]["walk_gbps"]
        # one Rice parameter per record's values: bit-exact, and the default coding (a
        # parameter per class where smaller) never larger than it
        k = s["one_value_parameter"]
        assert set(k) == set(ONE_PARAMETER_KEYS)
        for key, kind in ONE_PARAMETER_KEYS.items():
            assert isinstance(k[key], kind), (key, k[key])
        assert k["bit_exact"] is True
        assert s["wire_bytes"] < k["wire_bytes"]


def test_bench_codec_table_names_the_targets():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltarl.cli",
            "bench",
            "codec",
            "--params",
            "100000",
            "--steps",
            "1",
            "--repeat",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "bit-exact" in out.stdout
    assert "x the bound" in out.stdout
    assert "x memcpy" in out.stdout
    assert "values by class: wire" in out.stdout
    assert "apply without its decode, each part alone: writes" in out.stdout
    assert "its writes and verify alone" in out.stdout  # the apply target's ceiling here
    assert "its walk over the reference alone" in out.stdout  # the conditioned coding's
    for name in ("conditioned Rice", "conditioned Huffman"):
        assert f"{name}: " in out.stdout
        assert f"{name} bit-exact" in out.stdout  # and its verdicts
    # The apply agent applies in place: a separate reference is reported for comparison, and
    # no verdict holds it to the apply target as if a receiver still read one.
    assert "apply reading the reference from another buffer" in out.stdout
    verdicts = [line for line in out.stdout.splitlines() if line.lstrip().startswith("[")]
    assert verdicts
    assert not [v for v in verdicts if "other buffer" in v], verdicts
    # the range coder's walk is a floor under its own apply only: models 2 and 3 walk by
    # blocks of 64 elements, faster than it
    floors = [v for v in verdicts if "its walk over the reference alone" in v]
    assert floors, verdicts
    assert all(" conditioned apply" in v for v in floors), floors
    # its kernels' threads sleep between kernels as the agents' do: the policy was set before
    # torch (the simulation) loaded the OpenMP runtime they share (deltarl/ops/kernel_threads.py)
    assert "loaded already" not in out.stderr, out.stderr
