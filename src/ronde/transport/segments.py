"""Segment files in /dev/shm: one per rank, created by its owner, mapped by its peers.

Used by the shm transport (``shm.py``) and the negotiation mailboxes (``mailbox.py``).

``/dev/shm`` is shared by every user of the host, so a segment is made and opened as
no other user can interfere (see ``_private_files.py``, and docs/security.md):

* **Unguessable names.** ``ronde-<job key>-<tag>``, the tag an HMAC of the segment's
  label (generation, process set, rank) under the job's secret (:class:`Names`): the
  job's ranks can name each other's segments, nobody else can name one before it
  exists, nor the next from one seen in a listing.
* **Made new.** ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode ``0600``: a file already at the
  name is never reused or truncated (:class:`~ronde.SecurityError`, unless it is this
  user's own leftover, which is removed first); the memory is reserved at once
  (``posix_fallocate``), so a full ``/dev/shm`` is never a SIGBUS in the middle of a
  collective. ``init()`` sizes the segments to what each host's ``/dev/shm`` holds
  (``shm_room.py``: smaller segments, else tcp, with a warning); a reservation that still
  fails (something else took the space meanwhile) is an error naming the remedy.
* **Checked before mapping.** A peer's segment is opened with ``O_NOFOLLOW`` and
  ``fstat`` ed (this user's regular file, ``0600``) before it is mapped; a mismatch
  fails the start-up with a ``SecurityError`` naming the file.

The owner removes the name as soon as every peer has mapped it (:class:`OwnedSegment`),
so a crash leaves nothing behind, and ``ronderun`` removes what a killed job left
(:func:`remove_job_segments`, this user's files only).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import mmap
import os
import secrets
import stat
import tempfile
import time
from typing import Callable

from .._errors import ConfigError, RendezvousError, SecurityError
from .._private_files import open_checked


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Names:
    """The paths of one job's segments: ``<shm dir>/ronde-<job key>-<tag>``, where the
    tag is an HMAC-SHA256 of the segment's label under the job's secret (128 bits of
    it). ``secret``: the job's (every rank holds it after the rendezvous); empty for a
    job of one, whose segments no peer needs to find (a random one is used)."""

    def __init__(self, job_id: str, secret: bytes) -> None:
        self.prefix = _prefix(job_id)
        self._key = secret or secrets.token_bytes(32)

    def path(self, label: str) -> str:
        tag = hmac.new(self._key, b"ronde-shm\0" + label.encode(), hashlib.sha256)
        return os.path.join(shm_dir(), self.prefix + tag.hexdigest()[:32])

    def of(self, label: str) -> Callable[[int], str]:
        """The path of rank ``r``'s segment among those labelled ``label``."""
        return lambda r: self.path(f"{label}-{r}")


def create_segment(path: str, total: int) -> mmap.mmap:
    """Create this rank's segment file (new, mode 0600), reserve its memory, map it.

    Raises:
        SecurityError: something that is not this user's file is at ``path``.
        ConfigError: ``/dev/shm`` has no room for ``total`` bytes.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for attempt in range(3):
        try:
            fd = os.open(path, flags, 0o600)
            break
        except FileExistsError:
            _remove_own_leftover(path, planted=attempt == 2)
    else:  # (a name that someone keeps filling between two tries)
        raise SecurityError(f"shared-memory segment {path}: something else is made at this "
                            "name again and again; run without shared memory "
                            "(RONDE_TRANSPORT=tcp) and find who makes it")
    try:
        os.ftruncate(fd, total)
        _reserve(fd, path, total)
        return mmap.mmap(fd, total)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _remove_own_leftover(path: str, planted: bool) -> None:
    """A file at a segment's name: this user's own regular file is a leftover of a job
    with the same id and secret that was killed during its start-up, removed; anything
    else was put there by someone else (so is a file that keeps coming back:
    ``planted``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not planted:
        os.unlink(path)
        return
    kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
        "a file" if stat.S_ISREG(st.st_mode) else "something"
    raise SecurityError(
        f"shared-memory segment {path}: {kind} of uid {st.st_uid} is already there, not "
        f"made by this job (uid {os.getuid()}); ronde never uses a segment it did not "
        "create. Another user of this host may be attacking the job: remove it (as root) "
        "and start again, or run without shared memory (RONDE_TRANSPORT=tcp)")


def _reserve(fd: int, path: str, total: int) -> None:
    """Back the whole segment with memory now: a full tmpfs reports it here instead of
    killing the process with SIGBUS at the first write into a page it cannot give."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # a filesystem that cannot reserve: pages come on first touch, as before
        if exc.errno != errno.ENOSPC:
            raise
        where = os.path.dirname(path)
        free = os.statvfs(where)
        raise ConfigError(
            f"{where} has no room for this rank's shared-memory segment: {total} bytes "
            f"needed, {free.f_bavail * free.f_frsize} free (init() sized the segments to "
            f"what it found free: something else took it since, or a process set added "
            f"later needs more; about RONDE_SHM_SEGMENT per rank of this host and per shm "
            f"process set). Run over sockets "
            f"(RONDE_TRANSPORT=tcp), give each segment less (RONDE_SHM_SEGMENT=16MiB), or "
            f"enlarge {where} (`mount -o remount,size=8G {where}`; in Docker, "
            f"`--shm-size=8g`)") from None


def open_segment(path: str, total: int, deadline: float) -> mmap.mmap:
    """Map a peer's segment once it exists at full size, after checking it is this
    user's ``0600`` file (not a link, not another user's); RendezvousError after
    ``deadline`` (the peer failed during start-up), SecurityError at once on a file
    the job did not make."""
    while True:
        try:
            fd = open_checked(path, os.O_RDWR)
            try:
                if os.fstat(fd).st_size >= total:
                    return mmap.mmap(fd, total)
            finally:
                os.close(fd)
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise RendezvousError(f"shared-memory segment {path} did not appear; a peer "
                                  "on this host failed during start-up")
        time.sleep(0.002)


class OwnedSegment:
    """The name of this rank's segment file, removed once every peer has mapped it
    (or at close), so that a crash leaves nothing in /dev/shm."""

    _path: str
    _unlinked: bool = False

    def _unlink_if(self, everyone_attached: bool) -> None:
        if everyone_attached and not self._unlinked:
            self._unlink()

    def _unlink(self) -> None:
        self._unlinked = True
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass

    def _open_peer(self, path: str, total: int, deadline: float) -> mmap.mmap:
        """A peer's segment (:func:`open_segment`); where it never comes or is not the
        job's, this rank's own name goes too, before the error is raised."""
        try:
            return open_segment(path, total, deadline)
        except BaseException:
            self._unlink()
            raise


def close_maps(maps: "list[mmap.mmap]") -> None:
    for mm in maps:
        try:
            mm.close()
        except (BufferError, ValueError):
            pass  # a view is still alive somewhere; the mapping goes with the process


def job_key(job_id: str) -> str:
    """The file-name-safe form of a job id that starts its segments' names."""
    return "".join(c if c.isalnum() else "_" for c in job_id)


def _prefix(job_id: str) -> str:
    return f"ronde-{job_key(job_id)}-"


def remove_job_segments(job_id: str) -> int:
    """Unlink the segments a job of this user left behind (launcher clean-up after a
    crash); files of other users at such names are left alone."""
    import glob

    removed = 0
    for path in glob.glob(os.path.join(shm_dir(), f"{_prefix(job_id)}*")):
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed
