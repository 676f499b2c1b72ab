"""Moving memory that peers read onto huge pages (transport/hugepages.py), for real."""

from __future__ import annotations

import mmap
import tempfile

import numpy as np
import pytest

from ronde.transport import hugepages
from ronde.transport.hugepages import BLOCK, HugePages

needs_collapse = pytest.mark.skipif(not HugePages(True).active,
                                    reason="no MADV_COLLAPSE (Linux < 6.1) or THP off here")


def _anon(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Private anonymous memory (what malloc hands out), a block-aligned view of it."""
    m = mmap.mmap(-1, nbytes + BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, dtype=np.uint8)
    skip = (-raw.ctypes.data) % BLOCK
    return m, raw[skip: skip + nbytes]


def _huge_bytes(lo: int, hi: int) -> int:
    """AnonHugePages of the mappings overlapping [lo, hi), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                inside = a < hi and b > lo
            elif inside and head[0] == "AnonHugePages:":
                total += int(head[1]) * 1024
    return total


def _splits(lo: int, hi: int) -> int:
    """How many mapping boundaries lie strictly inside [lo, hi) (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        edges = {int(x, 16) for line in f for x in line.split()[0].split("-")}
    return sum(1 for e in edges if lo < e < hi)


def _thp_share(addr: int, nbytes: int) -> float | None:
    """The share of [addr, addr + nbytes) on transparent huge pages, or None where
    /proc/kpageflags cannot be read."""
    from ronde.bench.fusion_stages import small_page_share

    small = small_page_share([np.asarray(_Raw(addr, nbytes))])
    return None if small is None else 1.0 - small


class _Raw:
    """A buffer at a raw address, for numpy (read only by the page-flag check)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (addr, True), "shape": (nbytes,),
                                    "typestr": "|u1", "version": 3}


@needs_collapse
def test_a_block_seen_twice_moves_onto_a_huge_page_contents_unchanged(caplog, monkeypatch):
    m, buf = _anon(3 * BLOCK)
    buf[:] = np.arange(buf.size) % 251
    addr = buf.ctypes.data
    # a tensor that starts and ends inside blocks: its edges' blocks go too
    ranges = [(addr + 4096, 2 * BLOCK + 8192)]
    hp = HugePages(True)
    hp.prepare(ranges)
    assert hp.collapsed_bytes == 0  # seen once: memory used once is not worth a copy
    with caplog.at_level("DEBUG", logger="ronde.transport.hugepages"):
        hp.prepare(ranges)
    assert hp.collapsed_bytes == 3 * BLOCK and hp.refused == 0
    # the step that paid for it says so
    assert f"{3 * BLOCK >> 20} MiB of memory peers read moved onto huge pages" in caplog.text
    # and from then on nothing reads /proc/self/maps
    monkeypatch.setattr(hugepages, "_read_maps", lambda *a: pytest.fail("read the maps"))
    assert _huge_bytes(addr, addr + 3 * BLOCK) >= 3 * BLOCK
    assert (buf == np.arange(buf.size) % 251).all()

    calls = []
    fn = hp._fn
    hp._fn = lambda *a: calls.append(a) or fn(*a)
    for _ in range(3):
        hp.prepare(ranges)
    assert calls == []  # settled: the steady state makes no system call
    del buf
    m.close()


@needs_collapse
def test_a_block_where_a_huge_page_marked_mapping_begins_moves_too():
    # numpy marks an array of 4 MiB or more for huge pages from its first 4 KiB page
    # boundary: two anonymous mappings whose flags differ then meet inside a block, and
    # the kernel, which collapses only whole blocks inside one mapping, reports success
    # for that block while leaving it on 4 KiB pages. It must end up on a huge page.
    m, buf = _anon(2 * BLOCK)
    buf[:] = 7
    addr = buf.ctypes.data
    fn, _ = hugepages._libc_calls()
    assert fn(addr + BLOCK // 2, BLOCK + BLOCK // 2, 14) == 0  # MADV_HUGEPAGE, as numpy
    assert _splits(addr, addr + BLOCK) == 1
    hp = HugePages(True)
    for _ in range(2):
        hp.prepare([(addr, BLOCK)])
    # one mapping over the block now (what a collapse needs), and, where the page
    # flags are readable (root), its memory on one huge page
    assert _splits(addr, addr + BLOCK) == 0
    assert _thp_share(addr, BLOCK) in (None, 1.0)
    assert (buf == 7).all()
    del buf
    m.close()


@needs_collapse
def test_a_block_mostly_untouched_is_left_alone():
    # collapsing fills a block's holes: memory next to a tensor may be a large
    # allocation nobody touched, which must not become resident because of ronde
    m, buf = _anon(2 * BLOCK)
    addr = buf.ctypes.data
    buf[: BLOCK // 4] = 1  # the first block a quarter resident
    buf[BLOCK:] = 1  # the second one all
    hp = HugePages(True)
    for _ in range(2):
        hp.prepare([(addr, 2 * BLOCK)])
    assert hp.collapsed_bytes == BLOCK and hp.refused == 1
    _, mincore = hugepages._libc_calls()
    resident = np.zeros(BLOCK // mmap.PAGESIZE, dtype=np.uint8)
    assert mincore(addr, BLOCK, resident.ctypes.data) == 0
    assert int(np.count_nonzero(resident & 1)) == resident.size // 4  # no page added
    assert int(buf[: BLOCK // 4].sum()) == BLOCK // 4 and not buf[BLOCK // 4: BLOCK].any()
    del buf
    m.close()


@needs_collapse
def test_memory_the_kernel_refuses_is_left_alone():
    hp = HugePages(True)
    # an unmapped block
    m, buf = _anon(BLOCK)
    gone = buf.ctypes.data
    del buf
    m.close()
    # a file mapping (page cache, not anonymous memory)
    with tempfile.TemporaryFile() as fh:
        fh.truncate(2 * BLOCK)
        fm = mmap.mmap(fh.fileno(), 2 * BLOCK)
        view = np.frombuffer(fm, dtype=np.uint8)
        at = view.ctypes.data
        for _ in range(2):
            hp.prepare([(gone, BLOCK), (at, 2 * BLOCK)])
        assert hp.collapsed_bytes == 0 and hp.refused >= 2
        del view
        fm.close()


def test_nothing_is_done_when_disabled_or_where_thp_is_off(tmp_path):
    assert not HugePages(False).active
    HugePages(False).prepare([(0, BLOCK)])  # a no-op, even for a nonsense address
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    assert not hugepages.thp_allowed(str(never))
    never.write_text("always [madvise] never\n")
    assert hugepages.thp_allowed(str(never))
    assert not hugepages.thp_allowed(str(tmp_path / "missing"))


def _anonymous_only(block: int, maps) -> bool:
    return hugepages._mappings(block, hugepages._read_maps(str(maps)))[0]


def test_only_private_anonymous_memory_is_marked_for_huge_pages(tmp_path):
    # a block that straddles mappings gets MADV_HUGEPAGE only when every one of them is
    # private anonymous memory (or the heap): never a file, the stack or shared memory
    b = 64 * BLOCK
    maps = tmp_path / "maps"

    def line(lo, hi, perms="rw-p", name=""):
        return f"{lo:x}-{hi:x} {perms} 00000000 00:00 0          {name}\n"

    half = b + BLOCK // 2
    maps.write_text(line(b - 4096, half) + line(half, b + BLOCK, name="[heap]"))
    assert _anonymous_only(b, maps)
    maps.write_text(line(b, half) + line(half, b + BLOCK, "r--p", "/usr/lib/libc.so.6"))
    assert not _anonymous_only(b, maps)
    maps.write_text(line(b, half) + line(half, b + BLOCK, "rw-s", "/dev/shm/x"))
    assert not _anonymous_only(b, maps)
    maps.write_text(line(b, half))  # the rest unmapped
    assert not _anonymous_only(b, maps)
    maps.write_text(line(b, b + BLOCK, name="[stack]"))
    assert not _anonymous_only(b, maps)


_SPLIT_PROBE = """
import numpy as np
from ronde.transport import hugepages
assert hugepages.heap_for_tensors()
a = np.full((2 << 20) // 4, 1.0, np.float32)
b = np.full((9 << 20) // 4, 1.0, np.float32)  # numpy marks it for huge pages, mid-block
block = b.ctypes.data & ~(hugepages.BLOCK - 1)

def splits():
    with open("/proc/self/maps") as f:
        edges = {int(x, 16) for line in f for x in line.split()[0].split("-")}
    return sum(1 for e in edges if block < e < block + hugepages.BLOCK)

before = splits()
hp = hugepages.HugePages(True)
for _ in range(2):
    hp.prepare([(a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)])
print(before, splits(), bool((b == 1).all()))
"""


@needs_collapse
def test_the_heap_block_where_numpy_marks_a_large_array_moves_too():
    # the same on the heap, where the kernel reports success for the straddled block and
    # leaves it alone (on the private mapping above it says EINVAL instead)
    import subprocess
    import sys

    probe = subprocess.run([sys.executable, "-c", _SPLIT_PROBE], capture_output=True,
                           text=True, timeout=60)
    if "AssertionError" in probe.stderr:
        pytest.skip("the C library is not glibc")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["1", "0", "True"]


_HEAP_PROBE = """
import sys, numpy as np
from ronde.transport import hugepages
tuned = hugepages.heap_for_tensors() if sys.argv[1] == "1" else False
a = np.ones(1 << 18, np.float32)  # 1 MiB: above glibc's first mmap threshold (128 KiB)
at = a.ctypes.data
for line in open("/proc/self/maps"):
    if line.rstrip().endswith("[heap]"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        print(tuned, lo <= at < hi)
        break
else:
    print(tuned, False)
"""


def test_after_heap_for_tensors_a_mid_sized_tensor_comes_from_the_heap():
    # glibc maps each block above its mmap threshold on its own, often between shared
    # libraries, where it can never move onto a huge page; heap_for_tensors() sets the
    # threshold where glibc settles by itself, so that such tensors come from the heap
    import subprocess
    import sys

    def probe(tune: bool) -> list[str]:
        out = subprocess.run([sys.executable, "-c", _HEAP_PROBE, "1" if tune else "0"],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.split()

    tuned, in_heap = probe(True)
    if tuned != "True":
        pytest.skip("the C library is not glibc")
    assert in_heap == "True"
    assert probe(False) == ["False", "False"]  # glibc's default: a mapping of its own


_TRIM_PROBE = r"""
import ctypes, sys
from ronde.transport import hugepages

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 16 MiB blocks come from the heap
watch = hugepages.HeapWatch()
blocks = [ctypes.create_string_buffer(16 << 20) for _ in range(10)]  # touched (zeroed)
keep = blocks[-1]  # the top stays in use: only a trim inside the heap can give back
del blocks
before = rss()
first = watch.settle()   # the heap grew (from nothing): trimmed
after = rss()
again = watch.settle()   # no growth since: nothing done
# the same span touched again (blocks from the holes): resident, but no growth
span = hugepages.heap_bytes()
blocks = [ctypes.create_string_buffer(16 << 20) for _ in range(4)]
del blocks
grown = hugepages.heap_bytes() > span
touched = rss()
wandered = watch.settle()  # resident 64 MiB above the floor: trimmed
print(hugepages.heap_bytes() is not None, first, again, (before - after) >> 20, grown,
      wandered, (touched - rss()) >> 20, watch.settle())
"""


def test_a_heap_that_grew_or_was_touched_again_is_trimmed_and_its_pages_given_back():
    # ShardedOptimizer's step ends with HeapWatch.settle(): glibc keeps freed blocks
    # under its mmap threshold, and a process at a memory cap counts them
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    if out[0] != "True":
        pytest.skip("the C library has no mallinfo2 (not glibc >= 2.33)")
    assert out[1:3] == ["True", "False"]
    assert int(out[3]) >= 120  # 9 freed blocks of 16 MiB: at least 120 MiB given back
    # pages of the holes touched again, the span unchanged: trimmed for the resident rise
    assert out[4] == "False" and out[5] == "True" and int(out[6]) >= 48, out
    assert out[7] == "False"  # at the floor again: nothing to do
