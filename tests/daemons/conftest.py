"""The ``pipeline`` fixture: the refit daemons of tests/daemons/pipeline.py, killed after the
test whatever it left running (``request.param``: "shm" or "stream", default "shm")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemons.pipeline import Pipeline


@pytest.fixture
def pipeline(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pipeline]:
    pipe = Pipeline(tmp_path, getattr(request, "param", "shm"))
    try:
        yield pipe
    finally:
        pipe.kill_all()
