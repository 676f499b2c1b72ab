"""Segment files in /dev/shm: one per rank, created by its owner, mapped by its peers.

Used by the shm transport (``shm.py``) and the negotiation mailboxes (``mailbox.py``).
Files are ``0600`` and named ``ronde-<job key>-...``; the owner removes the name as soon
as every peer has mapped it (:class:`OwnedSegment`), so a crash leaves nothing behind,
and ``ronderun`` removes what a killed job left (:func:`remove_job_segments`).
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

from .._errors import RendezvousError


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def create_segment(path: str, total: int) -> mmap.mmap:
    """Create (or truncate) this rank's segment file, mode 0600, and map it."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, total)
        return mmap.mmap(fd, total)
    finally:
        os.close(fd)


def open_segment(path: str, total: int, deadline: float) -> mmap.mmap:
    """Map a peer's segment once it exists at full size; RendezvousError after
    ``deadline`` (the peer failed during start-up)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
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


def close_maps(maps: "list[mmap.mmap]") -> None:
    for mm in maps:
        try:
            mm.close()
        except (BufferError, ValueError):
            pass  # a view is still alive somewhere; the mapping goes with the process


def job_key(job_id: str) -> str:
    """The file-name-safe form of a job id used in segment names."""
    return "".join(c if c.isalnum() else "_" for c in job_id)


def remove_job_segments(job_id: str) -> int:
    """Unlink any segment a job left behind (launcher clean-up after a crash)."""
    import glob

    removed = 0
    for path in glob.glob(os.path.join(shm_dir(), f"ronde-{job_key(job_id)}-*")):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed
