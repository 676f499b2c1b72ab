"""Single-copy allreduce between processes of one host (Linux cross-memory attach).

``process_vm_readv`` lets a process copy bytes straight out of another process's
memory, given its pid and an address, when both run as the same user (the check
that ``ptrace`` would make). That removes the copy through a shared segment: a
rank reads exactly the parts of its peers' tensors it needs, where they lie.

The allreduce of N bytes over n ranks, per rank (``ShmCommunicator`` drives it and
provides the synchronisation counters):

1. publish the addresses of its tensors (the logical vector, possibly many tensors:
   fusion needs no fusion buffer here) and wait for every peer's;
2. reduce-scatter: for its block (N/n bytes), read each peer's part in cache-sized
   chunks into a small scratch buffer and reduce into its own tensors, then apply
   the post-scale while the chunk is still in cache;
3. allgather: read every other block directly from its owner's tensors into its own.

That is (n-1)/n·N read across processes for the reduction, (n-1)/n·N for the gather,
and one in-cache reduce: about one pass over the data plus half a reduction,
against the two copies plus a reduction of the shared-segment path.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import os
from typing import Sequence

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_MAX = 1024
_libc: ctypes.CDLL | None = None


def _readv() -> "ctypes._NamedFuncPointer | None":
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    fn = getattr(_libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


def supported() -> bool:
    """True when this process can call ``process_vm_readv`` (on itself, as a probe)."""
    fn = _readv()
    if fn is None:
        return False
    src = np.arange(4, dtype=np.int64)
    dst = np.zeros(4, dtype=np.int64)
    try:
        read_into(os.getpid(), [(dst.ctypes.data, dst.nbytes)], [(src.ctypes.data, src.nbytes)])
    except OSError:
        return False
    return bool((dst == src).all())


def read_into(pid: int, local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]
              ) -> None:
    """Copy the ``remote`` (address, length) ranges of ``pid`` into the ``local`` ones.

    Both lists describe the same number of bytes; partial transfers are resumed.
    Raises ``OSError`` (EPERM, ESRCH, EFAULT...) when the kernel refuses.
    """
    fn = _readv()
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available")
    local, remote = list(local), list(remote)
    total = sum(n for _, n in local)
    done = 0
    while done < total:
        lo_iov, lo_n = _slice(local, done, _IOV_MAX)
        re_iov, re_n = _slice(remote, done, _IOV_MAX)
        want = min(lo_n, re_n)
        lo_iov, _ = _slice(local, done, _IOV_MAX, want)
        re_iov, _ = _slice(remote, done, _IOV_MAX, want)
        larr = (_Iovec * len(lo_iov))(*[_Iovec(a, n) for a, n in lo_iov])
        rarr = (_Iovec * len(re_iov))(*[_Iovec(a, n) for a, n in re_iov])
        got = fn(pid, larr, len(lo_iov), rarr, len(re_iov), 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} made no progress")
        done += got


def _slice(ranges: Sequence[tuple[int, int]], skip: int, max_iov: int,
           limit: int | None = None) -> tuple[list[tuple[int, int]], int]:
    """The (address, length) ranges after skipping ``skip`` bytes, at most ``max_iov``
    of them and ``limit`` bytes; returns them and their byte count."""
    out: list[tuple[int, int]] = []
    count = 0
    for addr, n in ranges:
        if skip >= n:
            skip -= n
            continue
        addr, n = addr + skip, n - skip
        skip = 0
        if limit is not None:
            n = min(n, limit - count)
        if n <= 0:
            break
        out.append((addr, n))
        count += n
        if len(out) >= max_iov or (limit is not None and count >= limit):
            break
    return out, count


class Layout:
    """A logical vector made of several tensors, in bytes: maps ranges to addresses."""

    def __init__(self, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        self.addrs = list(addrs)
        self.lengths = list(lengths)
        self.starts = [0]
        for n in self.lengths:
            self.starts.append(self.starts[-1] + n)

    @property
    def nbytes(self) -> int:
        return self.starts[-1]

    def ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """(address, length) pieces covering logical bytes [lo, hi)."""
        out = []
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while lo < hi and i < len(self.lengths):
            start = self.starts[i]
            end = start + self.lengths[i]
            if end > lo and self.lengths[i]:
                a, b = max(lo, start), min(hi, end)
                out.append((self.addrs[i] + (a - start), b - a))
                lo = b
            i += 1
        return out
