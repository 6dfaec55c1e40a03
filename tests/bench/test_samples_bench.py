"""The `deltarl bench samples --json` contract, on a small group: one JSON object with these
keys, our path round-trips, and the dict form is measured beside it."""

from __future__ import annotations

import orjson
import pytest

from bench import samples as bench
from deltarl import cli

SECTIONS = {
    "ours": {
        "bytes",
        "from_lists_s",
        "encode_s",
        "put_s",
        "get_s",
        "decode_s",
        "total_s",
        "round_trip_ok",
    },
    "old": {"bytes", "dumps_s", "loads_s", "total_s", "control_cap_bytes", "over_control_cap"},
    "memcpy": {"bytes", "s"},
    "ratios": {
        "old_bytes_over_ours",
        "old_s_over_ours",
        "ours_s_over_memcpy",
        "ours_gbps",
        "memcpy_gbps",
    },
}


def test_bench_samples_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert "samples" in cli.BENCHES
    args = ["--samples", "4", "--tokens", "64", "--prompt-tokens", "8", "--repeat", "2", "--json"]
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = orjson.loads(lines[0])
    assert set(result) == {"samples", "completion_tokens", "prompt_tokens", "repeat", *SECTIONS}
    for section, keys in SECTIONS.items():
        assert set(result[section]) == keys, section
    assert (result["samples"], result["completion_tokens"]) == (4, 256)
    assert result["ours"]["round_trip_ok"] is True
    assert result["old"]["over_control_cap"] is False  # a small group still fits
    assert result["old"]["bytes"] > result["ours"]["bytes"] == result["memcpy"]["bytes"]
    assert all(v > 0 for v in result["ratios"].values())


def test_a_real_size_group_does_not_fit_the_control_plane() -> None:
    group = bench.make_group(16, 8192, 512)
    assert len(orjson.dumps(bench.old_form(group))) > bench.MAX_MESSAGE_BYTES
    assert group.tokens == 16 * 8192
