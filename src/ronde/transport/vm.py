"""Cross-memory attach: copy bytes between this process and another (Linux).

``process_vm_readv`` copies ranges of another process's memory into this one's,
``process_vm_writev`` the other way, given its pid and addresses, when both run as
the same user (the check ``ptrace`` would make). ``shm/single_copy.py`` builds the single-copy
collectives on them; this module only moves bytes, with ctypes (no compiled code).
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import itertools
import os
from typing import Sequence

import numpy as np

_IOV_MAX = 1024
_libc: ctypes.CDLL | None = None
_fns: dict[str, "ctypes._NamedFuncPointer | None"] = {}


def _syscall(name: str) -> "ctypes._NamedFuncPointer | None":
    """libc's ``process_vm_readv`` or ``process_vm_writev``, or None without it."""
    if name in _fns:
        return _fns[name]
    libc = libc_handle()
    if libc is None:
        return None
    fn = getattr(libc, name, None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        # iovec arrays are passed as addresses of (base, length) uint64 pairs
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                       ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    _fns[name] = fn
    return fn


def _iovecs(ranges: Sequence[tuple[int, int]]) -> "array.array[int]":
    """``struct iovec[]`` (two 64-bit fields each, as on x86-64); ``buffer_info()[0]``
    is its address. ``array.array`` builds one and gives its address in a quarter of
    a microsecond, a numpy array and its ``ctypes.data`` in 1.5."""
    return array.array("Q", _chain(ranges))


def address(arr: np.ndarray) -> int:
    """The address of a C-contiguous array's first byte (0.2 µs; ``ctypes.data`` 0.8)."""
    try:
        return ctypes.addressof(_BYTE.from_buffer(arr))
    except (TypeError, ValueError):  # read-only or empty: the slower, general way
        return arr.ctypes.data


_BYTE = ctypes.c_byte
_chain = itertools.chain.from_iterable


#: Yama's ptrace policy (absent without the Yama security module)
_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def ptrace_scope() -> int | None:
    """Yama's ptrace scope (0 classic, 1 descendants only, 2 admin only, 3 none), or None
    where the kernel has no Yama."""
    try:
        with open(_PTRACE_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None


def allow_peers() -> bool:
    """Let processes of this user read and write this one's memory although Yama
    restricts it to descendants (``ptrace_scope`` 1, Ubuntu's default): ranks on one
    host are siblings, so without this every single-copy read between them is refused
    and collectives fall back to two copies through shared memory. Open MPI's
    cross-memory-attach component does the same. It only lifts Yama's extra rule for
    this process (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``): the kernel still
    requires the same user (or CAP_SYS_PTRACE), as it does without Yama. Returns True
    when single-copy access is not blocked by Yama (now or before)."""
    scope = ptrace_scope()
    if scope is None or scope == 0:
        return True
    if scope != 1:
        return False  # 2: CAP_SYS_PTRACE only, 3: never; a process cannot lift them
    libc = libc_handle()
    if libc is None:
        return False
    fn = libc.prctl
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def libc_handle() -> "ctypes.CDLL | None":
    """This process's C library (loaded once, errno kept), or None."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        except OSError:
            return None
    return _libc


def supported() -> bool:
    """True when this process can call ``process_vm_readv`` (on itself, as a probe)."""
    if _syscall("process_vm_readv") is None:
        return False
    src = np.arange(4, dtype=np.int64)
    dst = np.zeros(4, dtype=np.int64)
    try:
        read_into(os.getpid(), [(dst.ctypes.data, dst.nbytes)], [(src.ctypes.data, src.nbytes)])
    except OSError:
        return False
    return bool((dst == src).all())


class Iov:
    """(address, length) ranges as a ready ``struct iovec[]``, built once for many calls
    (the single-copy allreduce keeps one per chunk and peer, see ``shm/single_copy.py``)."""

    __slots__ = ("ranges", "array", "addr", "count", "nbytes")

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = list(ranges)
        self.array = _iovecs(self.ranges)
        self.addr = self.array.buffer_info()[0]
        self.count = len(self.ranges)
        self.nbytes = sum(n for _, n in self.ranges)


def read_into(pid: int, local: "Sequence[tuple[int, int]] | Iov",
              remote: "Sequence[tuple[int, int]] | Iov") -> None:
    """Copy the ``remote`` (address, length) ranges of ``pid`` into the ``local`` ones
    (either a list of ranges or an :class:`Iov`).

    Both describe the same number of bytes; partial transfers are resumed.
    Raises ``OSError`` (EPERM, ESRCH, EFAULT...) when the kernel refuses.
    """
    _transfer("process_vm_readv", pid, local, remote)


def write_into(pid: int, local: "Sequence[tuple[int, int]] | Iov",
              remote: "Sequence[tuple[int, int]] | Iov") -> None:
    """Copy the ``local`` ranges into the ``remote`` ones of ``pid`` (as :func:`read_into`,
    the other way)."""
    _transfer("process_vm_writev", pid, local, remote)


def _transfer(name: str, pid: int, local: "Sequence[tuple[int, int]] | Iov",
              remote: "Sequence[tuple[int, int]] | Iov") -> None:
    fn = _fns.get(name) or _syscall(name)
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not available")
    lo = local if type(local) is Iov else Iov(local)  # type: ignore[arg-type]
    re = remote if type(remote) is Iov else Iov(remote)  # type: ignore[arg-type]
    total = lo.nbytes
    done = 0
    if lo.count <= _IOV_MAX and re.count <= _IOV_MAX and total:
        # the common case: one system call
        done = _check(fn(pid, lo.addr, lo.count, re.addr, re.count, 0), name, pid)
    while done < total:  # more iovecs than one call takes, or a partial transfer
        lo_iov, lo_n = _slice(lo.ranges, done, _IOV_MAX)
        re_iov, re_n = _slice(re.ranges, done, _IOV_MAX)
        want = min(lo_n, re_n)
        lo_iov, _ = _slice(lo.ranges, done, _IOV_MAX, want)
        re_iov, _ = _slice(re.ranges, done, _IOV_MAX, want)
        a, b = _iovecs(lo_iov), _iovecs(re_iov)
        done += _check(fn(pid, a.buffer_info()[0], len(lo_iov), b.buffer_info()[0],
                          len(re_iov), 0), name, pid)


def _check(got: int, name: str, pid: int) -> int:
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name} with pid {pid}: {os.strerror(err)}")
    if got == 0:
        raise OSError(errno.EFAULT, f"{name} with pid {pid} made no progress")
    return got


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
