"""Fixtures the codec fault tests share."""

from __future__ import annotations

import pytest

from tests.codecs.sample_delta import Case, make_case


@pytest.fixture(scope="module")
def case() -> Case:
    """One delta with every kind of record (sample_delta.py), built once per process."""
    return make_case()
