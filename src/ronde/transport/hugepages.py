"""Back the memory that peers read across processes with 2 MiB pages (Linux THP).

Single-copy collectives (``cma.py``) have peers copy a rank's tensors out of its
memory with ``process_vm_readv``, and the kernel pins the source pages one by one:
from 4 KiB pages it copies at about 6 GB/s here, from 2 MiB (transparent huge) pages
at about 20 GB/s (``python -m ronde.bench._membw``). numpy asks for huge pages only
for the inside of arrays of 4 MiB or more (the edges, and every smaller array, stay
on 4 KiB pages), torch's CPU allocator not at all: ResNet-50's 161 gradients,
allocated separately by numpy, sit 45 % on huge pages, by torch 0 %, and their fused
allreduce took 1.8-2.2x the time of one buffer of the same size, against 1.3-1.4x
once their memory was on huge pages.

So the owner of the memory moves it onto huge pages itself, once: each 2 MiB-aligned
block of address space that holds memory a peer will read is collapsed with
``madvise(MADV_COLLAPSE)`` (Linux 6.1; the kernel copies the block into one huge page,
in place, the contents unchanged), after ``MADV_HUGEPAGE`` when the block straddles
anonymous mappings (numpy marks its arrays for huge pages from a 4 KiB boundary, which
splits the mapping there): the kernel collapses only whole blocks inside one mapping,
and for a straddled one it reports EINVAL, or on the heap success while leaving it on
4 KiB pages, so the mappings are made alike first (they merge). Policy:

- a block is collapsed the second time it is seen (memory used once, a freshly
  allocated output, is not worth a copy at 4 GB/s); after that attempt, whatever its
  outcome, it is never tried again, so the steady state costs one set lookup per
  buffer (a training loop's persistent gradient buckets: the first steps pay, each
  such step logged at debug level with what moved, and then nothing reads
  ``/proc/self/maps``);
- a block is whole 2 MiB of address space: memory around a small tensor (its
  allocator's neighbours) moves onto the same huge page, its contents unchanged; a
  block not entirely mapped, or shared with a file mapping, is refused by the kernel
  and left alone, and ``MADV_HUGEPAGE`` goes only to blocks made entirely of private
  anonymous memory (``/proc/self/maps``);
- nothing is done where the kernel has no ``MADV_COLLAPSE``, where the system's THP
  setting is ``never``, under ``prctl(PR_SET_THP_DISABLE)``, or with
  ``RONDE_HUGEPAGES=0`` (the way to keep memory you marked ``MADV_NOHUGEPAGE`` so:
  ``MADV_HUGEPAGE`` on a straddled block would lift that mark there).

Where the tensors lie matters as much. glibc's ``malloc`` serves each block above its
mmap threshold (128 KiB at first) with a mapping of its own, which the kernel often
places in a gap between shared libraries: a 2 MiB block shared with a library's file
mapping can never be collapsed. glibc raises that threshold by itself, up to 32 MiB,
the first time a program frees such a block (every training loop does, within a
step), and blocks below it then come from the heap, whose 2 MiB blocks collapse. So
ronde starts there (:func:`heap_for_tensors`, once, by the shared-memory transport
where huge pages are in use: at ``init()``, before the model is built): the
mmap threshold at 32 MiB and the trim threshold at 64 MiB, the pair glibc itself
settles on. ResNet-50's 161 gradients, allocated by numpy right after ``init()``:
6-9 % of their memory left on 4 KiB pages without it, 2-3 % with it, and their fused
allreduce 1.30-1.36x one buffer against 1.17-1.20x (np=2, interleaved).

What it can cost: resident memory grows by the unpopulated part of each collapsed
block; a block is only collapsed when at least 90 % of its pages are resident already
(``mincore``), so by at most a tenth of what moves (in practice nothing: tensors and
their allocator's neighbours are written before they are reduced). Memory that is
unmapped and mapped again at the same address after its block was collapsed is
simply read at the 4 KiB rate (the record says "done"), never wrongly.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Iterable

import numpy as np


def _pmd_size(path: str = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") -> int:
    """The size of a transparent huge page here (2 MiB on x86-64)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 2 << 20


BLOCK = _pmd_size()
_PAGE = mmap.PAGESIZE
#: a block is collapsed only when at least this share of its pages is resident, so a
#: collapse never adds more than a tenth of a block to the process's memory
_MIN_RESIDENT = 0.9
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
#: forget the record past this many blocks or ranges (a few MiB of Python sets; blocks
#: forgotten are tried again, a no-op for those already on huge pages)
_MAX_RECORDED = 1 << 16
_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
log = logging.getLogger(__name__)


def thp_allowed(path: str = _SYSFS) -> bool:
    """False when the administrator turned THP off (``[never]``), or there is none."""
    try:
        with open(path) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _libc_calls() -> tuple["ctypes._NamedFuncPointer", "ctypes._NamedFuncPointer"] | None:
    """libc's ``madvise`` and ``mincore``, or None where either is missing or the kernel
    lacks ``MADV_COLLAPSE``."""
    from .vm import libc_handle

    libc = libc_handle()
    try:
        madvise, mincore = libc.madvise, libc.mincore  # type: ignore[union-attr]
    except AttributeError:  # no libc, or one without them
        return None
    madvise.restype = mincore.restype = ctypes.c_int
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    # an empty range: 0 where the advice is known, EINVAL where the kernel predates it
    if madvise(None, 0, _MADV_COLLAPSE) != 0:
        return None
    return madvise, mincore


#: glibc's ceiling for its own dynamic mmap threshold on 64-bit systems, and the trim
#: threshold it pairs with it (twice as much)
MMAP_THRESHOLD = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_heap_tuned = False


def heap_for_tensors() -> bool:
    """Set glibc's malloc where it settles by itself once a program has freed a large
    block (see the module doc): blocks up to ``MMAP_THRESHOLD`` from the heap, whose
    2 MiB blocks can move onto huge pages. Once per process; False where the C library
    is not glibc (whose ``mallopt`` parameters these are)."""
    global _heap_tuned
    if _heap_tuned:
        return True
    from .vm import libc_handle

    libc = libc_handle()
    if libc is None or getattr(libc, "gnu_get_libc_version", None) is None:
        return False
    mallopt = libc.mallopt
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _heap_tuned = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                   and mallopt(_M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD) == 1)
    return _heap_tuned


def trim_heap() -> bool:
    """Hand the free pages of glibc's heap back to the system (``malloc_trim(0)``: whole
    free pages anywhere in it, not only at its top), after memory that stays unused was
    freed, e.g. every parameter's old memory once it moved into a flat buffer (the heap
    keeps blocks under ``MMAP_THRESHOLD``, and the process would go on counting them).
    False where the C library is not glibc."""
    from .vm import libc_handle

    libc = libc_handle()
    if libc is None or getattr(libc, "malloc_trim", None) is None \
            or getattr(libc, "gnu_get_libc_version", None) is None:
        return False
    libc.malloc_trim.restype = ctypes.c_int
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes() -> int | None:
    """The bytes glibc's heaps span (``mallinfo2().arena``: in use and free), or None
    where the C library has no ``mallinfo2`` (not glibc, or older than 2.33)."""
    from .vm import libc_handle

    libc = libc_handle()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().arena)


class HeapWatch:
    """Trims glibc's heap after a step that left pages it no longer uses resident
    (:meth:`settle`).

    A training step frees blocks of many sizes (autograd's gradients, the optimizer's
    temporaries); glibc keeps them in its heap, and where a later request fits no hole
    the heap grows, so over the first steps a process counts pages it no longer uses:
    measured, 50-120 MiB a rank at 1.5 GiB (``ShardedOptimizer``, np=2). And where the
    heap has large holes (a model's old parameters, moved into flat buffers), a step's
    transients land in a different hole from one step to the next, each time touching
    pages that then stay resident: at 38-40 ``Linear(2048, 2048)`` layers, stage 2,
    np=4, the memory charged after a step wandered up by 30-70 MiB over the steps, and a
    step's own peak came on top. So a step that left the heap larger than any before
    hands its free pages back (``malloc_trim``), and so does a step that left the
    process resident by more than :data:`SLACK` above its *floor*: what it was after
    the first step since the last trim, i.e. with a step's own transients touched again
    (trimming those every step would give back and fault in 30-50 MiB a step, 4-6 ms of
    ``malloc_trim`` and as much in faults). Measured at np=2, stage 2: 0-2 trims in 20
    steady steps at 4 and at 20 layers; at np=4, 40 layers, a 1536 MiB cap (and one
    reduce-scatter in flight): the model trains in 2 runs of 2, a peak charge of 1520
    MiB, where 38 layers were the most before. A step that trims
    nothing costs one ``mallinfo2`` call and one read of ``/proc/self/statm``. Nothing
    happens where either call is missing."""

    def __init__(self) -> None:
        self.largest = 0  # the heap's span after the last step that grew it
        #: resident bytes after the first step since the last trim (its transients
        #: touched again): the level a step returns to; None: to be read at the next
        self.floor: int | None = None

    def settle(self) -> bool:
        """Trim the heap if it grew, or the process's resident memory rose by more than
        :data:`SLACK` above its floor, since the last trim; returns whether it did."""
        span, resident = heap_bytes(), resident_bytes()
        if span is None or resident is None:
            return False
        if span <= self.largest:
            if self.floor is None:
                self.floor = resident
            if resident <= self.floor + SLACK:
                return False
        self.largest, self.floor = max(self.largest, span), None
        return trim_heap()


#: how far the resident memory may rise above its floor before :meth:`HeapWatch.settle`
#: trims (under a 16 MiB block: one more of autograd's gradients of a 2048x2048 layer)
SLACK = 16 << 20


def resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    """This process's resident memory in bytes (None where ``/proc`` is missing)."""
    try:
        with open(statm, "rb") as fh:
            return int(fh.read().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return None


class HugePages:
    """Per-communicator record of the blocks seen, and the collapses made."""

    def __init__(self, enabled: bool = True) -> None:
        calls = _libc_calls() if enabled and thp_allowed() else None
        self._fn, self._mincore = calls if calls is not None else (None, None)
        self._resident = np.zeros(BLOCK // _PAGE, dtype=np.uint8)
        self._seen: set[int] = set()
        self._tried: set[int] = set()
        self._settled: set[tuple[int, int]] = set()
        #: bytes moved onto huge pages, and blocks the kernel refused (for tests, logs)
        self.collapsed_bytes = 0
        self.refused = 0

    @property
    def active(self) -> bool:
        return self._fn is not None

    def prepare(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Called with the (address, length) ranges of this rank's memory that peers
        are about to read; collapses the blocks seen before (see the module doc)."""
        if self._fn is None:
            return
        settled = self._settled
        due: list[int] = []
        for addr, n in ranges:
            if n <= 0 or (addr, n) in settled:
                continue
            if self._visit(addr, n, due):
                if len(settled) >= _MAX_RECORDED:
                    settled.clear()
                settled.add((addr, n))
        if due:
            # lazily, each block once ever: the steady state of a training loop reads no
            # /proc here. Logged (RONDE_LOG_LEVEL=debug): the step that pays for it shows
            spans = _read_maps()  # once for all the blocks due now
            was = self.collapsed_bytes, self.refused
            for block in due:
                self._collapse(block, spans)
            log.debug("huge pages: %d MiB of memory peers read moved onto huge pages, "
                      "%d blocks refused (RONDE_HUGEPAGES=0 turns this off)",
                      (self.collapsed_bytes - was[0]) >> 20, self.refused - was[1])

    def _visit(self, addr: int, n: int, due: list[int]) -> bool:
        """Add the blocks of one range seen before to ``due``; True when all were tried."""
        seen, tried = self._seen, self._tried
        if len(seen) + len(tried) >= _MAX_RECORDED:
            seen.clear()
            tried.clear()
        all_tried = True
        for b in range(addr & ~(BLOCK - 1), addr + n, BLOCK):
            if b in tried:
                continue
            if b not in seen:
                seen.add(b)
                all_tried = False
                continue
            seen.discard(b)
            tried.add(b)
            due.append(b)
        return all_tried

    def _collapse(self, block: int, spans: list[tuple[int, int, bool]]) -> None:
        fn, mincore = self._fn, self._mincore
        assert fn is not None and mincore is not None
        # only blocks already (nearly) all in memory: a collapse fills the holes, and
        # memory next to a tensor may be a large allocation nobody has touched yet
        vec = self._resident
        if mincore(block, BLOCK, vec.ctypes.data) != 0 or \
                int(np.count_nonzero(vec & 1)) < _MIN_RESIDENT * vec.size:
            self.refused += 1
            return
        anonymous, pieces = _mappings(block, spans)
        if anonymous and pieces > 1:
            # anonymous mappings whose flags differ meet inside the block (numpy marks
            # its arrays for huge pages from a 4 KiB boundary): the kernel collapses
            # only whole blocks inside one mapping, and reports success for a block it
            # left alone. Marking the block alike merges them.
            fn(block, BLOCK, _MADV_HUGEPAGE)
        if fn(block, BLOCK, _MADV_COLLAPSE) == 0 and (anonymous or pieces == 1):
            self.collapsed_bytes += BLOCK
            return
        self.refused += 1


def _read_maps(maps: str = "/proc/self/maps") -> list[tuple[int, int, bool]]:
    """This process's mappings: (start, end, private anonymous?), in address order (the
    heap counts as anonymous; files, the stack and shared memory do not)."""
    out = []
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                name = fields[5].strip() if len(fields) > 5 else ""
                out.append((lo, hi, fields[1][3] == "p" and name in ("", "[heap]")))
    except (OSError, ValueError, IndexError):
        return []
    return out


def _mappings(block: int, spans: list[tuple[int, int, bool]]) -> tuple[bool, int]:
    """Whether [block, block + BLOCK) lies entirely in private anonymous mappings (only
    those get ``MADV_HUGEPAGE`` from ronde), and how many mappings it spans."""
    end, covered, pieces, anonymous = block + BLOCK, 0, 0, True
    for lo, hi, anon in spans:
        if hi <= block or lo >= end:
            continue
        pieces += 1
        anonymous = anonymous and anon
        covered += min(hi, end) - max(lo, block)
    return anonymous and covered == BLOCK, pieces
