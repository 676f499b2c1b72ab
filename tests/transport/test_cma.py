"""Cross-memory attach helpers: byte ranges over several tensors, and real reads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ronde.transport import vm
from ronde.transport.shm import single_copy as cma

pytestmark = pytest.mark.skipif(not vm.supported(), reason="process_vm_readv refused here")


def test_layout_ranges_cover_exactly_the_requested_bytes():
    lay = cma.Layout([1000, 5000, 9000], [10, 0, 30])
    assert lay.nbytes == 40
    assert lay.ranges(0, 40) == [(1000, 10), (9000, 30)]
    assert lay.ranges(5, 15) == [(1005, 5), (9000, 5)]
    assert lay.ranges(12, 12) == []
    assert lay.ranges(39, 40) == [(9029, 1)]


def test_read_into_gathers_scattered_ranges_in_many_calls():
    src = [np.arange(n, dtype=np.uint8) for n in (3, 1, 5000, 7)]
    dst = [np.zeros(n, dtype=np.uint8) for n in (2, 5009)]
    remote = [(a.ctypes.data, a.nbytes) for a in src] * 1  # 5011 bytes
    local = [(d.ctypes.data, d.nbytes) for d in dst]
    cma.read_into(os.getpid(), local, remote)
    assert bytes(np.concatenate(dst)) == bytes(np.concatenate(src))
    # more pieces than one system call takes (IOV_MAX)
    many = [np.full(1, i % 256, dtype=np.uint8) for i in range(3000)]
    out = np.zeros(3000, dtype=np.uint8)
    cma.read_into(os.getpid(), [(out.ctypes.data, 3000)], [(a.ctypes.data, 1) for a in many])
    assert (out == np.arange(3000) % 256).all()


def test_bad_address_is_an_oserror_not_a_crash():
    out = np.zeros(8, dtype=np.uint8)
    with pytest.raises(OSError):
        cma.read_into(os.getpid(), [(out.ctypes.data, 8)], [(8, 8)])


def test_coalesce_merges_only_buffers_adjacent_in_memory():
    from ronde.transport.shm.single_copy import coalesce

    flat = np.arange(100, dtype=np.float32)
    other = np.ones(5, np.float32)
    parts = [flat[0:10], flat[10:30], flat[30:30], flat[30:60], other, flat[60:100]]
    merged, addrs = coalesce(parts)
    assert [m.size for m in merged] == [60, 5, 40]
    assert addrs == [m.ctypes.data for m in merged]
    assert merged[0].ctypes.data == flat.ctypes.data and merged[1] is other
    merged[0][:] = -1  # a merged buffer writes through to the tensors it stands for
    assert (flat[:60] == -1).all() and flat[60] == 60
