"""Sleeping on a word of shared memory until another process changes it (Linux futex).

Where it sits: the shm data plane (``shm/communicator.py``) waits for a peer's counter
to reach a value. Polling for it is fast when every rank has a core of its own; when
ranks outnumber the cores, a poller takes the core that the rank it waits for needs.
A futex lets the waiter sleep in the kernel on the counter's address and the owner
wake it with one system call, and only when someone sleeps there.

``wait(address, seen, timeout_s)`` sleeps while the 32-bit word at ``address`` still
holds ``seen`` (the kernel compares atomically with ``wake``, so a change between the
caller's last look and the call is never missed: the call returns at once).
``wake(address)`` wakes every sleeper on it. Both go through libc's ``syscall`` with
ctypes (about a microsecond each); the words live in ``MAP_SHARED`` mappings, so the
shared (not process-private) futex operations are used. Where futexes are missing
(not Linux), :data:`AVAILABLE` is False and callers sleep in short steps instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import time

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(
    platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> "ctypes._NamedFuncPointer | None":
    if _SYS_FUTEX is None or not os.uname().sysname == "Linux":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


_syscall = _load()
#: whether :func:`wait` really sleeps in the kernel
AVAILABLE = _syscall is not None


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` differs from ``seen`` (its low 32
    bits), a :func:`wake`, or ``timeout_s``; may return early (callers look again)."""
    if _syscall is None:
        time.sleep(min(timeout_s, 0.0002))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAIT),
             ctypes.c_long(seen & 0xFFFFFFFF), ctypes.byref(ts), None, ctypes.c_long(0))


def wake(address: int) -> None:
    """Wake every process sleeping in :func:`wait` on ``address``."""
    if _syscall is not None:
        _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(address), ctypes.c_long(_FUTEX_WAKE),
                 ctypes.c_long(_WAKE_ALL), None, None, ctypes.c_long(0))


def cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def cores() -> int:
    """How many CPUs this process may run on."""
    return len(cpus())
