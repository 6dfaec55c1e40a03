"""``deltarl model`` and ``deltarl layout``: what a host prepares before its daemons start.

The layout file an apply agent creates its rollout store with, on a host without the trainer,
must be the trainer's published layout exactly (names, order, shapes, bf16, offsets): a store
made with another one would refuse the trainer's versions, or worse, misplace them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarl import host_setup
from deltarl.engine.layout import Layout
from deltarl.trainer.publisher import layout_of
from deltarl.trainer.service import load_model


def test_the_layout_file_is_the_trainers_published_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert host_setup.model_main(["tiny", "--root", str(tmp_path / "models")]) == 0
    model_dir = Path(capsys.readouterr().out.strip())
    assert (model_dir / "config.json").is_file()
    out = tmp_path / "layout.json"
    assert host_setup.layout_main([str(model_dir), "--out", str(out)]) == 0
    written = Layout.from_json(out.read_bytes())
    assert written == layout_of(load_model(model_dir))
    assert len(written) > 10
    assert not list(tmp_path.glob(".layout.json.*")), "the temporary file was left behind"


def test_a_directory_without_a_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "layout.json"
    assert host_setup.layout_main([str(tmp_path), "--out", str(out)]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert not out.exists()
