"""Writing a small file so that a reader sees the old one or the whole new one, never half."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """``data`` to ``path``: a temporary file beside it, flushed to disk, then renamed over it
    (a crash leaves the old file, or none, and at worst a temporary that is removed on error)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
