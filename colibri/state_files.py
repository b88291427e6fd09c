"""Files in the state directory, opened without following links; the directory checked at start.

The state directory holds what the engine reads back (KV slots, routing heat) and what the server
publishes (``experts.json``). Anyone who can create names in it could plant a symbolic link where
we are about to write (the write lands on the link's target: any file our user may write) or read
(the server hands out the target). So, for every file there (and for Channel snapshots, which use
the same writer):

- the final component is never followed (``O_NOFOLLOW``): a planted link is refused, not used;
- a temp file is created exclusively (``O_CREAT|O_EXCL``); a name already there (a crash's
  leftover, or a planted link) is unlinked first, which removes the link, never its target;
- a read opens regular files only (``fstat`` after the open), non-blocking, so a FIFO planted in
  place of a file cannot hang the reader;
- the directory must belong to our user (or root) and be writable by no one else, checked once at
  start (``check_state_dir``): then only our user can plant anything, and the rules above are the
  second line.

Directories on the way to the file are followed: a state directory that is a link (to another disk,
say) is a normal setup; it is resolved once and the directory it names is the one checked.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from colibri.errors import ConfigError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
# Where O_NOFOLLOW meets a link: ELOOP on Linux and macOS, EMLINK on FreeBSD.
_LINK_ERRNOS = (errno.ELOOP, errno.EMLINK)
FILE_MODE = 0o600  # a KV cache encodes the conversation: as private as the conversation itself
DIR_MODE = 0o700  # a state directory we create: its files' names say which slots are in use


class Refused(Exception):
    """A file we will not open or load; the message is the reason shown to the user."""


# --- the directory ----------------------------------------------------------------------------------


def _private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is ``uid``'s user private group (its own name, no other members): the setup
    where umask 002 is the default, so a directory we made is group-writable by our user alone."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and not set(group.gr_mem) - {user.pw_name}


def check_state_dir(path: Path) -> Path:
    """``path`` resolved (created 0o700 if missing); ConfigError unless it is a directory of this
    process's user (or root) that no other user can write: world-writable (sticky bit or not),
    group-writable (unless the group is the user's private group), or another user's."""
    path = Path(path)
    where = f"state directory {str(path)!r}"
    try:
        if not os.path.lexists(path):
            path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        real = Path(os.path.realpath(path))
        st = os.stat(real)
    except OSError as e:
        raise ConfigError(f"{where} cannot be created or read: {e.strerror or e}") from None
    if real != path.absolute():
        where += f" (which is {str(real)!r})"
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{where} is not a directory")
    euid, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    hint = "another user could plant links or files in it that the engine would read back"
    if st.st_uid not in (euid, 0):
        raise ConfigError(f"{where} belongs to uid {st.st_uid}, not to this user ({euid}): {hint}; "
                          "use a directory of your own")
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _private_group(st.st_gid, euid)):
        who = "every user" if mode & stat.S_IWOTH else f"group {st.st_gid}"
        raise ConfigError(f"{where} is writable by {who} (mode {mode:04o}): {hint}; "
                          "`chmod go-w` it or use another --state-dir")
    return real


def ensure_dir(path: Path) -> None:
    """``path`` exists (a snapshot's directory, made on first save); a new one is synced into its
    parent, so that the file about to be renamed into it survives power loss with it."""
    if not path.is_dir():
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        fsync_dir(path.parent)


# --- writing ----------------------------------------------------------------------------------------


def fsync(fd: int) -> None:
    """fsync, or on macOS F_FULLFSYNC: its fsync does not flush the drive's write cache."""
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # file systems without F_FULLFSYNC: plain fsync is the best there is
    os.fsync(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or creation inside ``path`` durable: the entry lives in the directory's data."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def create_exclusive(path: Path) -> int:
    """A new file at ``path`` (FILE_MODE), open for writing; never through a link. A name already
    there (a crash's leftover temp, or a link planted in its place) is unlinked and the file created
    again; OSError if that name is not ours to remove or comes back at once (a second writer)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        return os.open(path, flags, FILE_MODE)
    except FileExistsError:
        pass
    try:
        os.unlink(path)  # a link's own name: its target is untouched
    except FileNotFoundError:
        pass
    except OSError as e:  # a directory (EISDIR, EPERM), or another user's name in a sticky directory
        raise OSError(e.errno, f"{path} is in the way and cannot be removed: {e.strerror}") from None
    try:
        return os.open(path, flags, FILE_MODE)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"{path} came back after it was removed: another process "
                              "is writing here (two engines on one state directory?)") from None


def _is(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` names (not through a link) the file ``st`` describes."""
    try:
        here = os.lstat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino)


@contextmanager
def replacing(path: Path, temp: Path, sync: Callable[[int], None] = fsync) -> Iterator[BinaryIO]:
    """A new file for the block to write, that replaces ``path`` whole when the block ends, at every
    instant and after any crash either the old content or the new (docs/persistence.md): ``temp``
    created exclusively, its data synced with ``sync`` before the rename, the directory after. If
    the block raises, ``temp`` is removed and ``path`` stays as it was."""
    ensure_dir(path.parent)
    fd = create_exclusive(temp)
    ours = os.fstat(fd)
    try:
        with open(fd, "wb", closefd=True) as f:
            yield f
            f.flush()
            sync(f.fileno())  # data before name: the final name must never point at unwritten blocks
            if not _is(temp, ours):
                raise OSError(errno.ESTALE, f"{temp} was replaced while it was written: another process "
                              "is writing here (two engines on one state directory?)")
        os.replace(temp, path)  # atomic on POSIX; a link at ``path`` is replaced, not followed
    except BaseException:
        if _is(temp, ours):  # never another writer's file
            try:
                os.unlink(temp)
            except OSError:
                pass
        raise
    fsync_dir(path.parent)  # the rename itself survives power loss only once the directory is synced


# --- reading ----------------------------------------------------------------------------------------


def open_regular(path: Path) -> tuple[int, int] | None:
    """(fd, size) of ``path``, None if it does not exist; Refused if it is a link (not followed),
    not a regular file or cannot be opened. O_NONBLOCK: a FIFO in place of the file opens at once
    (and is then refused) instead of waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise Refused("is a directory, not a file") from None
    except OSError as e:
        if e.errno in _LINK_ERRNOS and os.path.islink(path):
            raise Refused("is a symbolic link, which is not followed here") from None
        raise Refused(f"cannot open: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Refused("is a directory, not a file" if stat.S_ISDIR(st.st_mode) else "is not a regular file")
    return fd, st.st_size


def read_regular(path: Path, max_bytes: int) -> bytes | None:
    """The whole of ``path``, None if it does not exist; Refused as ``open_regular``, or if it holds
    more than ``max_bytes`` (checked before reading and while reading: it may grow)."""
    if (opened := open_regular(path)) is None:
        return None
    fd, size = opened
    with open(fd, "rb", closefd=True) as f:
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
    if size > max_bytes or len(data) > max_bytes:
        raise Refused(f"holds more than {max_bytes} bytes")
    return data
