"""Who may have made, or may change, the shared-memory files and socket directories we use.

A weight-store segment, a shm link's directory and files, and an ``ipc://`` socket all live
in places other users can reach (/dev/shm is world-writable). A file another user made first
(or one anyone may write) would let that user rewrite what we read, an active weight buffer
say, undetected. So every such path is checked before use, on the open file descriptor
(``os.fstat``, never the path again: no check-then-use race), opened with ``O_NOFOLLOW``:

    a file we use        regular, owned by this process's effective uid, and no write bit
                         for group or others (a segment may grant read: ``mode=0o640``)
    a private directory  a directory owned by the euid, no bit at all for group or others
                         (0700); a link directory is made so, its files 0600
    an ipc socket's      owned by the euid or root, and writable by nobody else: in a
    directory            shared writable directory, even a sticky one like /tmp, another
                         user can take the socket's name first and answer our clients
    any directory above  owned by the euid or root, and writable by others only if sticky
                         (/dev/shm, /tmp): else another user could rename what it holds

Anything else is refused with UnsafePathError, a ConfigError: the configuration names a path
this process must not trust, and restarting will not change that.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from deltarl.config.errors import ConfigError

GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH
GROUP_OTHER_ANY = 0o077


class UnsafePathError(ConfigError):
    """A file or directory that another user made or may change: refused."""


def _owner_text(uid: int) -> str:
    return f"uid {uid}" + (" (root)" if uid == 0 else "")


def check_file(
    fd: int, path: Path | str, what: str, *, owner: int | None = None, readable: bool = True
) -> os.stat_result:
    """The stat of the file open as ``fd``, if it is one this process may trust; else
    UnsafePathError naming ``what`` and ``path``.

    ``owner``: the uid it must belong to (default: this process's euid). ``readable``: group
    and others may read it (never write); False: no bit for them at all.
    """
    st = os.fstat(fd)
    want = os.geteuid() if owner is None else owner
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{what} {path} is not a regular file; refused")
    if st.st_uid != want:
        raise UnsafePathError(
            f"{what} {path} belongs to {_owner_text(st.st_uid)}, not to "
            f"{_owner_text(want)} (this process); refused: its owner could rewrite it. "
            f"Remove it (or use another name) and start again"
        )
    bad = GROUP_OTHER_WRITE if readable else GROUP_OTHER_ANY
    if st.st_mode & bad:
        allowed = "may not be written" if readable else "may not be read or written"
        raise UnsafePathError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}; refused: it {allowed} "
            f"by group or others. Remove it and start again"
        )
    return st


def check_trusted_dirs(directory: Path | str, what: str) -> None:
    """``directory`` and every directory above it (symbolic links resolved) are owned by the
    euid or root, and writable by others only with the sticky bit; else UnsafePathError."""
    real = Path(os.path.realpath(directory))
    euid = os.geteuid()
    for d in [real, *real.parents]:
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue  # not made yet: whoever makes it is checked when it is used
        if st.st_uid not in (0, euid):
            raise UnsafePathError(
                f"{what}: directory {d} belongs to {_owner_text(st.st_uid)}; refused: it "
                f"could replace what {what} keeps there"
            )
        if st.st_mode & GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
            raise UnsafePathError(
                f"{what}: directory {d} has mode {stat.S_IMODE(st.st_mode):04o} (writable by "
                f"group or others, not sticky); refused: others could replace what it holds"
            )


def check_private_dir(directory: Path | str, what: str) -> None:
    """``directory`` (not a symbolic link) is a directory owned by the euid with no bit for
    group or others, and the directories above it are trusted; else UnsafePathError."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(
                f"{what}: {directory} is not a directory (a symbolic link?); refused"
            ) from None
        raise
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{what}: directory {directory} belongs to {_owner_text(st.st_uid)}, not to this "
            f"process ({_owner_text(os.geteuid())}); refused: its owner could replace the "
            f"files in it. Remove it and start again"
        )
    if st.st_mode & GROUP_OTHER_ANY:
        raise UnsafePathError(
            f"{what}: directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}; refused: "
            f"it must be 0700 (no access for group or others). Remove it and start again"
        )
    check_trusted_dirs(Path(directory).parent, what)


def check_socket_dir(directory: Path | str, what: str) -> None:
    """Where an ipc:// socket may be bound: ``directory`` owned by the euid or root and
    writable by nobody else (sticky or not), the directories above it trusted."""
    st = os.stat(directory)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafePathError(
            f"{what}: directory {directory} belongs to {_owner_text(st.st_uid)}; refused"
        )
    if st.st_mode & GROUP_OTHER_WRITE:
        raise UnsafePathError(
            f"{what}: directory {directory} has mode {stat.S_IMODE(st.st_mode):04o}; refused: "
            f"others may write there, so another user could take the socket's name first and "
            f"answer its clients. Put the socket in a private directory (such as "
            f"$XDG_RUNTIME_DIR or a 0700 directory of your own under /dev/shm)"
        )
    check_trusted_dirs(directory, what)
