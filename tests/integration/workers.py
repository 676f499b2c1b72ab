"""Functions run inside real worker processes by the integration tests.

Each takes its expectations from rank()/size(), so one function runs at any np.
"""

from __future__ import annotations

import time

import numpy as np

DTYPES = ["int32", "int64", "uint8", "float16", "float32", "float64"]


def _bf16():
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:
        return None


def collectives() -> str:
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    dtypes = [np.dtype(d) for d in DTYPES] + ([_bf16()] if _bf16() is not None else [])
    for length in (0, 1, 7, 1001, 300_007):
        for dt in dtypes:
            if length > 1001 and dt.kind != "f":
                continue
            base = (np.arange(length) % 5 + 1)
            x = (base + r).astype(dt)
            ref = sum((base + i).astype(np.float64) for i in range(n))
            got = hvd.allreduce(x, op=hvd.Sum, name=f"sum.{length}.{dt}")
            assert got.dtype == dt and got.shape == x.shape
            tol = 5e-2 if dt.itemsize == 2 and dt.kind == "f" or str(dt) == "bfloat16" else 1e-6
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=tol)
            mx = hvd.allreduce(x, op=hvd.Max, name=f"max.{length}.{dt}")
            np.testing.assert_array_equal(mx.astype(np.float64), (base + n - 1).astype(dt).astype(np.float64))
            mn = hvd.allreduce(x, op=hvd.Min, name=f"min.{length}.{dt}")
            np.testing.assert_array_equal(mn.astype(np.float64), base.astype(dt).astype(np.float64))
    p = hvd.allreduce(np.full(5, 2.0), op=hvd.Product)
    np.testing.assert_allclose(p, np.full(5, 2.0 ** n))
    avg = hvd.allreduce(np.full((3, 2), float(r)))  # default op: Average
    np.testing.assert_allclose(avg, np.full((3, 2), (n - 1) / 2))
    sc = hvd.allreduce(np.ones(4), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    np.testing.assert_allclose(sc, np.full(4, float(n)))
    old = hvd.allreduce(np.ones(3) * r, average=False)
    np.testing.assert_allclose(old, np.full(3, n * (n - 1) / 2))
    scalar = hvd.allreduce(np.float64(r + 1), op=hvd.Sum)
    assert scalar.shape == () and float(scalar) == n * (n + 1) / 2
    nc = np.arange(20.0).reshape(4, 5)[:, ::2]  # non-contiguous input
    np.testing.assert_allclose(hvd.allreduce(nc, op=hvd.Sum), nc * n)
    outs = hvd.grouped_allreduce([np.ones(3) * r, np.ones((2, 2)) * r], op=hvd.Sum)
    np.testing.assert_allclose(outs[1], np.full((2, 2), n * (n - 1) / 2))
    big = np.full(3_000_001, r + 1.0, dtype=np.float32)
    np.testing.assert_allclose(hvd.allreduce(big, op=hvd.Sum), n * (n + 1) / 2)
    # allgather: first dimension differs per rank
    g = hvd.allgather(np.full((r + 1, 3), r, dtype=np.int64))
    assert g.shape == (n * (n + 1) // 2, 3)
    np.testing.assert_array_equal(g[:, 0], np.concatenate([np.full(i + 1, i) for i in range(n)]))
    assert hvd.allgather(np.zeros((0, 2)) if r == 0 else np.ones((1, 2))).shape == (n - 1, 2)
    # large and ragged (the single-copy path on shm), one rank with nothing to send
    rows = 0 if r == 1 else 30_001 * (r + 1)
    big_g = hvd.allgather(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) + r)
    want = [np.arange((0 if q == 1 else 30_001 * (q + 1)) * 3, dtype=np.float32) + q
            for q in range(n)]
    np.testing.assert_array_equal(big_g.reshape(-1), np.concatenate(want))
    # broadcast from every root
    for root in range(n):
        b = hvd.broadcast(np.arange(10) * (r + 1), root_rank=root)
        np.testing.assert_array_equal(b, np.arange(10) * (root + 1))
    bb = hvd.broadcast(np.full(2_000_003, float(r)), root_rank=n - 1)
    assert (bb == n - 1).all()
    inplace = np.full(300_001, float(r), dtype=np.float32)
    hvd.broadcast_async(inplace, root_rank=0, name="bcast.inplace", out=inplace).wait()
    assert (inplace == 0).all()
    # alltoall, equal and explicit splits
    a = hvd.alltoall(np.arange(2 * n) + 100 * r)
    np.testing.assert_array_equal(a, np.concatenate([np.arange(2 * r, 2 * r + 2) + 100 * j
                                                     for j in range(n)]))
    splits = [(r + j) % 3 for j in range(n)]
    data = np.concatenate([np.full(s, 10 * r + j) for j, s in enumerate(splits)]).astype(np.int32)
    out, rs = hvd.alltoall(data, splits=splits)
    expect_rs = [(j + r) % 3 for j in range(n)]
    assert list(rs) == expect_rs
    np.testing.assert_array_equal(out, np.concatenate([np.full(s, 10 * j + r)
                                                       for j, s in enumerate(expect_rs)]))
    # reducescatter: first dim split as evenly as possible, earlier ranks get the extra rows
    rows = 2 * n + 1
    rsum = hvd.reducescatter(np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (r + 1),
                             op=hvd.Sum)
    base, extra = divmod(rows, n)
    start = r * base + min(r, extra)
    mine = base + (1 if r < extra else 0)
    ref = np.arange(rows * 2, dtype=np.float64).reshape(rows, 2)[start:start + mine]
    np.testing.assert_allclose(rsum, ref * n * (n + 1) / 2)
    ravg = hvd.reducescatter(np.ones((n, 3)) * r)
    np.testing.assert_allclose(ravg, np.full((1, 3), (n - 1) / 2))
    # large (the single-copy paths on shm): ragged alltoall with an empty slot,
    # reducescatter of odd rows with Sum and Average
    bsplits = [0 if (r + j) % 3 == 0 else 20_011 * ((r + j) % 3) + j for j in range(n)]
    bdata = np.concatenate([np.arange(c, dtype=np.int64) * n + 1000 * r + j
                            for j, c in enumerate(bsplits)])
    bout, brs = hvd.alltoall(bdata, splits=bsplits)
    bexp = [0 if (q + r) % 3 == 0 else 20_011 * ((q + r) % 3) + r for q in range(n)]
    assert list(brs) == bexp
    np.testing.assert_array_equal(bout, np.concatenate(
        [np.arange(c, dtype=np.int64) * n + 1000 * q + r for q, c in enumerate(bexp)]))
    rows = 70_001
    x = (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) % 1001) * (r + 1)
    base, extra = divmod(rows, n)
    start, mine = r * base + min(r, extra), base + (1 if r < extra else 0)
    ref = (np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) % 1001)[start:start + mine]
    np.testing.assert_array_equal(hvd.reducescatter(x, op=hvd.Sum), ref * (n * (n + 1) // 2))
    np.testing.assert_allclose(hvd.reducescatter(x.astype(np.float64), op=hvd.Average),
                               ref * (n + 1) / 2)
    # objects, async forms, barrier
    assert hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(("r", r)) == [("r", i) for i in range(n)]
    h = hvd.allreduce_async(np.ones(3), op=hvd.Sum, name="async")
    hvd.barrier()
    np.testing.assert_allclose(hvd.synchronize(h), np.full(3, float(n)))
    assert hvd.poll(h)
    hvd.shutdown()
    return "ok"


def mismatch() -> float:
    import ronde as hvd

    hvd.init()
    shape = (5,) if hvd.rank() == 1 else (4,)
    t = time.monotonic()
    try:
        hvd.allreduce(np.ones(shape, np.float32), name="grad.fc1.weight")
    except hvd.TensorMismatchError as exc:
        msg = str(exc)
        assert "allreduce 'grad.fc1.weight'" in msg and "rank 1 sent float32[5]" in msg, msg
        assert "float32[4]" in msg and "same shape" in msg, msg
    else:
        raise AssertionError("no mismatch error")
    elapsed = time.monotonic() - t
    # still usable
    assert float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0]) == hvd.size()
    hvd.shutdown()
    return elapsed


def join_uneven() -> int:
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for step in range(r + 1):  # rank r has r+1 batches
        got = hvd.allreduce(np.ones(3) * (r + 1), op=hvd.Average, name=f"g{step}")
        # joined ranks add zeros; Average divides by every rank (Horovod's rule)
        expect = sum(q + 1 for q in range(n) if q >= step) / n
        np.testing.assert_allclose(got, np.full(3, expect))
    last = hvd.join()
    hvd.shutdown()
    return last


def process_sets() -> list:
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set(hvd.ProcessSet(range(0, n, 2)))
    odds = hvd.add_process_set([q for q in range(1, n, 2)])
    mine = evens if r % 2 == 0 else odds
    got = hvd.allreduce(np.ones(2) * r, op=hvd.Sum, process_set=mine)
    np.testing.assert_allclose(got, np.full(2, float(sum(mine.ranks))))
    big = hvd.allreduce(np.full(300_001, float(r), np.float32), op=hvd.Sum, process_set=mine)
    np.testing.assert_allclose(big, float(sum(mine.ranks)))  # single-copy path on shm
    g = hvd.allgather(np.array([r]), process_set=mine)
    np.testing.assert_array_equal(g, mine.ranks)
    b = hvd.broadcast(np.array([r]), root_rank=mine.ranks[-1], process_set=mine)
    assert b[0] == mine.ranks[-1]
    assert mine.included() and mine.rank() == mine.ranks.index(r)
    result = [evens.process_set_id, odds.process_set_id]
    assert hvd.remove_process_set(odds)
    hvd.shutdown()
    return result


def reinit() -> float:
    import ronde as hvd

    worst = 0.0
    for i in range(3):
        t = time.monotonic()
        hvd.init()
        worst = max(worst, time.monotonic() - t)
        assert float(hvd.allreduce(np.ones(1) * i, op=hvd.Sum)[0]) == i * hvd.size()
        hvd.shutdown()
        assert not hvd.is_initialized()
    return worst


def topology() -> tuple:
    import ronde as hvd

    hvd.init()
    from ronde import _state
    from ronde.transport.futex import cores

    out = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
           hvd.cross_size(), hvd.is_homogeneous(), hvd.active_transport(),
           _state.require().engine.exchange.spin_s, cores(),
           _state.require().engine.round_hold.hold_s)
    hvd.shutdown()
    return out


def misuse() -> str:
    """Regressions found in review: each of these used to hang or misbehave."""
    import glob
    import os

    import pytest

    import ronde as hvd
    from ronde.transport.segments import job_key, shm_dir

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # shm segments are unlinked once mapped, even if the only collective is a broadcast
    hvd.broadcast(np.ones(2), root_rank=0)
    hvd.broadcast(np.ones(2), root_rank=0)
    left = glob.glob(os.path.join(shm_dir(), f"ronde-{job_key(os.environ['RONDE_JOB_ID'])}-*"))
    assert left == [], left
    first = hvd.add_process_set([0])
    rest = hvd.add_process_set(list(range(1, n)))
    mine, other = (first, rest) if r == 0 else (rest, first)
    # a non-member gets an immediate error, not a hang
    with pytest.raises(hvd.RondeError, match="not a member"):
        hvd.allreduce(np.ones(1), process_set=other)
    # the same name in two disjoint process sets is two different tensors
    got = hvd.allreduce(np.ones(2) * (r + 1), name="grad", op=hvd.Sum, process_set=mine)
    np.testing.assert_allclose(got, np.full(2, float(sum(q + 1 for q in mine.ranks))))
    hvd.shutdown()
    with pytest.raises(hvd.RondeError, match="subset"):
        hvd.init(comm=[0, 1])
    assert not hvd.is_initialized()
    return "ok"


def plain_allreduce() -> float:
    import ronde as hvd

    hvd.init()
    out = float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
    hvd.shutdown()
    return out


def steady_state() -> str:
    """Repeated names: the response cache and the inline path for small tensors."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for step in range(30):
        for dt in ("float32", "float64", "int32", "float16"):
            x = (np.arange(5) + r + step).astype(dt)
            got = hvd.allreduce(x, op=hvd.Sum, name=f"s.{dt}")
            ref = sum((np.arange(5) + q + step).astype(np.float64) for q in range(n))
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-3)
        avg = hvd.allreduce(np.full(3, float(r)), name="avg", prescale_factor=2.0,
                            postscale_factor=0.5)
        np.testing.assert_allclose(avg, np.full(3, (n - 1) / 2))
        mx = hvd.allreduce(np.array([r, -r], np.int64), op=hvd.Max, name="max")
        np.testing.assert_array_equal(mx, [n - 1, 0])
        # a large tensor under a repeated name still goes through the data plane
        big = hvd.allreduce(np.full(70_000, 1.0, np.float32), op=hvd.Sum, name="big")
        assert float(big[0]) == n and float(big[-1]) == n
        hs = [hvd.allreduce_async(np.full(2, float(r + i)), op=hvd.Sum, name=f"h{i}")
              for i in range(8)]
        for i, h in enumerate(hs):
            np.testing.assert_allclose(hvd.synchronize(h), np.full(2, float(sum(range(n)) + n * i)))
        # small ones beside a large one of the same reduction fuse into its transfer
        # (not inline); a small one of another dtype beside them rides inline
        parts = [np.full(k, float(r + k), np.float32) for k in (3, 70_000, 5, 1)]
        parts.append(np.full(4, r + 1, np.int32))
        hs = [hvd.allreduce_async(p, op=hvd.Sum, name=f"side{i}") for i, p in enumerate(parts)]
        for p, h in zip(parts, hs):
            want = (sum(range(n)) + n * p.size if p.dtype == np.float32
                    else n * (n + 1) // 2)
            got = hvd.synchronize(h)
            assert got.dtype == p.dtype and got.shape == p.shape
            np.testing.assert_array_equal(got, np.full(p.size, want, p.dtype))
        # a run of small ones in one round, reduced together where dtype and op agree
        kinds = [("float32", hvd.Sum), ("float32", hvd.Sum), ("int32", hvd.Sum),
                 ("int32", hvd.Max), ("float64", hvd.Average), ("float32", hvd.Average),
                 ("float32", hvd.Average)]
        hs = [hvd.allreduce_async((np.arange(3 + i) * (r + 1) + i).astype(dt), op=op,
                                  name=f"mix{i}") for i, (dt, op) in enumerate(kinds)]
        for i, ((dt, op), h) in enumerate(zip(kinds, hs)):
            each = [(np.arange(3 + i) * (q + 1) + i).astype(np.float64) for q in range(n)]
            ref = (np.maximum.reduce(each) if op == hvd.Max else
                   sum(each) / (n if op == hvd.Average else 1))
            got = hvd.synchronize(h)
            assert got.dtype == np.dtype(dt) and got.shape == (3 + i,)
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-6)
    # uneven data after the cache is warm: joined ranks contribute zeros
    for step in range(r + 1):
        got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="uneven")
        np.testing.assert_allclose(got, np.full(2, float(sum(1 for q in range(n) if q >= step))))
    hvd.join()
    hvd.shutdown()
    return "ok"


def multihost() -> tuple:
    """Collectives on simulated hosts (2 ranks per host): hierarchical allreduce."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for length in (1, 1001, 1_000_003):
        x = np.arange(length, dtype=np.float32) % 7 + r
        got = hvd.allreduce(x, op=hvd.Sum, name=f"h.{length}")
        np.testing.assert_allclose(got, (np.arange(length) % 7) * n + n * (n - 1) / 2)
    g = hvd.allgather(np.full((r + 1, 2), r))
    assert g.shape == (n * (n + 1) // 2, 2)
    b = hvd.broadcast(np.arange(5) + r, root_rank=n - 1)
    np.testing.assert_array_equal(b, np.arange(5) + n - 1)
    # the shared-memory part reads peers in place unless RONDE_CMA=0 (once ignored here)
    cma_used = hvd._api.runtime().engine.sets.get(0).local._cma
    out = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           hvd.active_transport(), cma_used)
    hvd.shutdown()
    return out


def timeline_job(path: str, kill_rank0: bool) -> str:
    import os
    import signal

    import ronde as hvd

    hvd.init()
    for step in range(5):
        hs = [hvd.allreduce_async(np.ones(100 * (i + 1)), name=f"grad.{i}") for i in range(4)]
        for h in hs:
            hvd.synchronize(h)
        hvd.allgather(np.ones((2, 2)), name="gathered")
    hvd.allreduce(np.ones(200_000), name="big")
    time.sleep(0.3)  # events reach the file at least every 0.1 s
    if kill_rank0 and hvd.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.shutdown()
    return path


def dynamic_timeline_job(folder: str) -> list[str]:
    """``HOROVOD_TIMELINE=DYNAMIC``: no file at init; ``start_timeline`` records,
    ``stop_timeline`` closes; returns what the working directory and ``folder`` held at
    each point."""
    import os

    import ronde as hvd

    hvd.init()
    hvd.allreduce(np.ones(10), name="before")
    seen = [f"cwd: {sorted(os.listdir('.'))}"]
    path = os.path.join(folder, "dyn-{rank}.json")
    hvd.start_timeline(path)
    hvd.allreduce(np.ones(10), name="during")
    hvd.stop_timeline()
    hvd.allreduce(np.ones(10), name="after")
    seen.append(f"folder: {sorted(os.listdir(folder))}")
    hvd.shutdown()
    return seen


def _rank1_busy_elsewhere() -> None:
    time.sleep(6)


def stall() -> str:
    import ronde as hvd

    hvd.init()
    if hvd.rank() == 1:
        _rank1_busy_elsewhere()
        return "late"
    try:
        hvd.allreduce(np.ones(2), name="grad.only_on_rank0")
    except hvd.StallError as exc:
        msg = str(exc)
        assert "'grad.only_on_rank0'" in msg and "missing on rank(s) 1" in msg, msg
        assert "ready on rank(s) 0" in msg, msg
        assert "_rank1_busy_elsewhere" in msg, msg  # what the missing rank was doing
        return "stalled"
    raise AssertionError("no StallError")


def fused_large() -> str:
    """Many mid-size tensors at once: fused, and on shm read straight from the peers."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sizes = [50_001, 7, 120_000, 3, 99_999, 1, 64_000]
    for step in range(3):
        for dt in ("float32", "float64", "int64"):
            ts = [(np.arange(s) % 5 + r + step).astype(dt) for s in sizes]
            if (r + step) % 2:  # views of one buffer here, separate arrays on the next
                # rank: the single-copy path merges adjacent tensors on this rank only
                ts = np.split(np.concatenate(ts), np.cumsum(sizes)[:-1])
            hs = [hvd.allreduce_async(t, op=hvd.Sum, name=f"f{i}.{dt}", out=t)
                  for i, t in enumerate(ts)]
            for h in hs:
                hvd.synchronize(h)
            for s, t in zip(sizes, ts):
                ref = sum((np.arange(s) % 5 + q + step).astype(np.float64) for q in range(n))
                np.testing.assert_allclose(t.astype(np.float64), ref)
        avg = [np.full(s, float(r), np.float32) for s in sizes]
        hs = [hvd.allreduce_async(t, name=f"avg{i}", prescale_factor=2.0, postscale_factor=0.25)
              for i, t in enumerate(avg)]
        for h in hs:
            np.testing.assert_allclose(hvd.synchronize(h), (n - 1) / 4)
    hvd.shutdown()
    return "ok"


def hugepages_steady() -> tuple:
    """Separately allocated tensors allreduced step after step over single-copy reads:
    from the second step each rank moves them onto huge pages (transport/hugepages.py)
    while peers keep reading them; every step's values stay exact. Returns (huge pages
    active, bytes collapsed, malloc thresholds set, a 1 MiB array from the heap)."""
    import ronde as hvd

    hvd.init()
    # right after init() (before any large block is freed, which would move glibc's
    # threshold by itself): on the heap where the malloc setting was made
    mid = np.ones(1 << 18, np.float32)  # 1 MiB: above glibc's first mmap threshold
    r, n = hvd.rank(), hvd.size()
    ts = [np.empty(s, np.float32) for s in (700_000, 3, 1_500_000, 5_000)]
    for step in range(4):
        for i, t in enumerate(ts):
            t[:] = np.arange(t.size) % 7 + r + step + i
        hs = [hvd.allreduce_async(t, op=hvd.Sum, name=f"hp{i}", out=t) for i, t in enumerate(ts)]
        for h in hs:
            hvd.synchronize(h)
        for i, t in enumerate(ts):
            want = n * (np.arange(t.size) % 7 + step + i) + n * (n - 1) // 2
            np.testing.assert_array_equal(t, want.astype(np.float32))
    comm = hvd._api.runtime().engine.sets.get(0)
    from ronde.transport import hugepages

    with open("/proc/self/maps") as f:
        heap = [tuple(int(x, 16) for x in line.split()[0].split("-"))
                for line in f if line.rstrip().endswith("[heap]")]
    on_heap = any(lo <= mid.ctypes.data < hi for lo, hi in heap)
    out = (comm.hugepages.active, comm.hugepages.collapsed_bytes, hugepages._heap_tuned,
           on_heap)
    hvd.shutdown()
    return out


def _before_gather_reads(action) -> None:
    """Call ``action()`` before each single-copy read of the gather phase (after this
    rank published REDUCED, until its next op starts)."""
    from ronde.transport.shm import communicator as shm
    from ronde.transport.shm import counters
    from ronde.transport.shm import single_copy as cma

    real_read, real_publish = cma.read_into, counters.Counters.publish
    phase = [""]

    def publish(self, idx, t):
        if idx == shm.REDUCED:
            phase[0] = "gather"
        elif idx == shm.WRITTEN:
            phase[0] = ""
        real_publish(self, idx, t)

    def read(pid, local, remote):
        if phase[0] == "gather":
            action()
        real_read(pid, local, remote)

    cma.read_into, counters.Counters.publish = read, publish
    import types

    import ronde as hvd

    comm = hvd._api.runtime().engine.sets.get(0)  # built at init: its bound publish
    comm.publish = types.MethodType(publish, comm.counters)


def _refuse_writes() -> None:
    """Make single-copy writes fail here, as where ``process_vm_writev`` is refused."""
    from ronde.transport import vm
    from ronde.transport.shm import single_copy

    def refused(pid, local, remote):
        raise PermissionError(1, "process_vm_writev refused")

    vm.write_into = single_copy.write_into = refused  # the probe, and the collectives


def _slow_reductions(seconds: float) -> None:
    """Make every reduction of this process sleep first (a slow owner)."""
    from ronde.collectives import ops

    fast = ops.reduce_into

    def slow(dst, src, op):
        time.sleep(seconds)
        fast(dst, src, op)

    ops.reduce_into = slow


def slow_owner_progressive() -> int:
    """Single-copy allreduce where writes are refused (the pull gather) and rank 1 is
    slow to reduce its block: rank 0 gathers rank 1's block chunk by chunk as it is
    reported reduced, and never reads a chunk early. Returns how many reads rank 0
    made in the allgather phase."""

    import ronde as hvd

    _refuse_writes()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 1:
        _slow_reductions(0.02)
    gathers = [0]
    if r == 0:
        _before_gather_reads(lambda: gathers.__setitem__(0, gathers[0] + 1))
    x = np.arange(2 << 20, dtype=np.float32) % 1000 + r  # 8 MiB: 4 chunks per block
    hvd.allreduce_async(x, op=hvd.Sum, name="x", out=x).wait()
    np.testing.assert_array_equal(x, (np.arange(2 << 20) % 1000) * n + n * (n - 1) // 2)
    assert not hvd._api.runtime().engine.sets.get(0).push_agreed
    hvd.shutdown()
    return gathers[0]


def owners_push_reduced_chunks() -> tuple:
    """Single-copy allreduce where writes work: every owner writes each reduced chunk
    of its block into every peer, and nobody reads a reduced block back; values exact,
    also for a vector of several tensors whose chunks straddle them.
    Returns (reads, writes) this rank made in the op."""
    import ronde as hvd
    from ronde.transport.shm import single_copy as cma

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    counts = {"read": 0, "write": 0}
    real_read, real_write = cma.read_into, cma.write_into

    def read(pid, local, remote):
        counts["read"] += 1
        real_read(pid, local, remote)

    def write(pid, local, remote):
        counts["write"] += 1
        real_write(pid, local, remote)

    hvd.allreduce(np.ones(1 << 20, np.float32), name="warm")  # agree on the path first
    cma.read_into, cma.write_into = read, write
    # 3 x 2 MiB plus odd sizes: 7 MiB in all, so that each block spans 2-4 chunks
    xs = [np.arange(k, dtype=np.float32) % 977 + r for k in (1 << 19, 333_333, 1 << 19,
                                                                 1 << 19, 131_071)]
    with hvd._api.together():  # one round, so one fused op (under load the five could
        # split over two rounds, and two ops cross more chunks: CI saw 6 on 2026-12-05)
        hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"x{i}", out=x)
              for i, x in enumerate(xs)]
    for h in hs:
        h.wait()
    for x in xs:
        np.testing.assert_array_equal(x, (np.arange(x.size) % 977) * n + n * (n - 1) // 2)
    assert hvd._api.runtime().engine.sets.get(0).push_agreed
    hvd.shutdown()
    return counts["read"], counts["write"]


def slow_owner_block_shrinks() -> list:
    """Single-copy allreduces where rank 1 reduces slowly: the blocks move so that its
    own shrinks, the same on every rank; every value stays exact meanwhile.
    Returns the block sizes (in elements) of the last op."""

    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 1:
        _slow_reductions(0.004)
    comm = hvd._api.runtime().engine.sets.get(0)
    for step in range(6):
        x = np.arange(3 << 20, dtype=np.float32) % 1000 + r + step  # 12 MiB
        hvd.allreduce_async(x, op=hvd.Sum, name="x", out=x).wait()
        want = (np.arange(3 << 20) % 1000 + step) * n + n * (n - 1) // 2
        np.testing.assert_array_equal(x, want)
    (key,) = comm.split._shares
    blocks = comm.split.blocks(key, 3 << 20, 4)
    hvd.shutdown()
    return [hi - lo for lo, hi in blocks]


def chunk_plans_reused() -> tuple:
    """Single-copy allreduces of two sets of separately allocated tensors, alternated,
    while rank 1 reduces slowly (so the blocks move every op): every value exact, and
    the per-chunk plans of whole chunks are built once per set of layouts, not per op.
    Returns how many times each whole chunk's plan was built for each set of layouts,
    how many sets of layouts there were, and how many ops ran."""
    import ronde as hvd
    from ronde.transport.shm import single_copy as cma

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    if r == 1:
        _slow_reductions(0.002)
    built: dict = {}
    real_chunk = cma._Chunk
    whole = (1 << 20) // 4  # elements in a chunk

    class Counted(real_chunk):  # type: ignore[misc, valid-type]
        def __init__(self, a, b, item, layouts, *rest):
            if a % whole == 0 and b - a == whole:
                key = (a, b, tuple(map(id, layouts)))  # kept alive by the plan cache
                built[key] = built.get(key, 0) + 1
            super().__init__(a, b, item, layouts, *rest)

    cma._Chunk = Counted
    sizes = (1 << 19, 333_333, 77, 1 << 20, 131_071, 5)  # 7.8 MiB, odd sizes
    sets = [[np.empty(k, np.float32) for k in sizes] for _ in range(2)]
    ops = 12
    for step in range(ops):
        xs = sets[step % 2]
        for i, x in enumerate(xs):
            x[:] = np.arange(x.size) % 997 + r + step + i
        with hvd._api.together():  # one round: one set of layouts per set of tensors
            hs = [hvd.allreduce_async(x, op=hvd.Sum, name=f"x{i}", out=x)
                  for i, x in enumerate(xs)]
        for h in hs:
            h.wait()
        for i, x in enumerate(xs):
            want = (np.arange(x.size) % 997 + step + i) * n + n * (n - 1) // 2
            np.testing.assert_array_equal(x, want)
    hvd.shutdown()
    return list(built.values()), len({key[2] for key in built}), ops


def single_copy_collectives_taken() -> dict:
    """Which large collectives took the single-copy path (counted), values checked."""
    import ronde as hvd
    from ronde.transport.shm import single_copy

    counts: dict = {}
    real_write = single_copy.write_into

    def write(pid, local, remote):
        counts["writes"] = counts.get("writes", 0) + 1
        real_write(pid, local, remote)

    single_copy.write_into = write
    for name in ("alltoallv", "reducescatter", "allgatherv", "broadcast"):
        real = getattr(single_copy, name)

        def counted(*a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*a, **k)

        setattr(single_copy, name, counted)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = np.arange(n * 40_000, dtype=np.float32) + r
    got = hvd.alltoall(x)
    np.testing.assert_array_equal(got, np.concatenate(
        [np.arange(r * 40_000, (r + 1) * 40_000, dtype=np.float32) + q for q in range(n)]))
    np.testing.assert_array_equal(hvd.reducescatter(x, op=hvd.Sum),
                                  np.arange(r * 40_000, (r + 1) * 40_000) * n + n * (n - 1) / 2)
    np.testing.assert_array_equal(  # each rank writes its input into its peers' outputs
        hvd.allgather(x), np.concatenate([np.arange(n * 40_000, dtype=np.float32) + q
                                          for q in range(n)]))
    hvd.broadcast(x, root_rank=0)
    hvd.shutdown()
    return counts


def rank_order_sums() -> str:
    """A single-copy allreduce sums every element in rank order, ((x0 + x1) + x2) + ...,
    whichever rank owns it, so the result does not depend on the blocks or the fusion:
    checked bit for bit against numpy, for one tensor and for the same values split
    into several tensors fused in one op; and the reducescatter alike."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    count = 3 << 18  # 3 MiB of float32: every rank owns a block of it

    def values(q: int) -> np.ndarray:  # wide magnitudes: association changes the bits
        rng = np.random.default_rng(q)
        return (rng.standard_normal(count) * 10.0 ** rng.integers(-4, 8, count)).astype(
            np.float32)

    want = values(0)
    for q in range(1, n):
        want = want + values(q)  # float32, left to right
    got = hvd.allreduce(values(r), op=hvd.Sum, name="one")
    np.testing.assert_array_equal(got, want)
    cuts = [0, 100_003, 400_000, 1_500_001, count]
    parts = [values(r)[a:b].copy() for a, b in zip(cuts, cuts[1:])]
    hs = [hvd.allreduce_async(p, op=hvd.Sum, name=f"part{i}", out=p)
          for i, p in enumerate(parts)]
    for h in hs:
        h.wait()
    np.testing.assert_array_equal(np.concatenate(parts), want)
    base, extra = divmod(count, n)  # the reducescatter sums in rank order too
    start, mine = r * base + min(r, extra), base + (1 if r < extra else 0)
    np.testing.assert_array_equal(hvd.reducescatter(values(r), op=hvd.Sum),
                                  want[start:start + mine])
    hvd.shutdown()
    return "ok"


def cma_write_denied_on_one_rank() -> tuple:
    """If one rank may read its peers but not write into them, every rank reads in
    place and nobody pushes."""
    import ronde as hvd

    if int(__import__("os").environ["RONDE_RANK"]) == 1:
        _refuse_writes()
    hvd.init()
    x = np.full(300_000, hvd.rank() + 1.0, np.float32)
    for _ in range(3):
        np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, name="x"),
                                   hvd.size() * (hvd.size() + 1) / 2)
    n = hvd.size()
    np.testing.assert_array_equal(hvd.allgather(x), np.repeat(np.arange(1.0, n + 1), x.size))
    comm = hvd._api.runtime().engine.sets.get(0)
    out = (comm._cma, comm.push_agreed)
    hvd.shutdown()
    return out


def cma_denied_on_one_rank() -> bool:
    """If one rank cannot read its peers' memory, every rank takes the shm path alike."""
    import ronde as hvd
    from ronde.transport import vm

    if int(__import__("os").environ["RONDE_RANK"]) == 1:
        vm.supported = lambda: False  # as if process_vm_readv were refused here
    hvd.init()
    x = np.full(300_000, hvd.rank() + 1.0, np.float32)
    for _ in range(3):
        np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, name="x"),
                                   hvd.size() * (hvd.size() + 1) / 2)
    decision = hvd._api.runtime().engine.sets.get(0)._cma
    hvd.shutdown()
    return decision


def mpi_comm_init() -> list:
    """Horovod's init(comm=...) with an mpi4py communicator: the world, not a subset."""
    from mpi4py import MPI

    import ronde as hvd

    hvd.init(comm=MPI.COMM_WORLD)
    total = float(hvd.allreduce(np.ones(1), op=hvd.Sum)[0])
    hvd.shutdown()
    sub = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.Get_rank() % 2)
    try:
        hvd.init(comm=sub)
        refused = False
    except hvd.RondeError as exc:
        refused = "a subset is not supported" in str(exc)
    return [total, refused, hvd.is_initialized()]


def many_new_names() -> str:
    """One round announcing more than a mailbox slot holds (the frame goes by socket),
    then the same names again (cached: small frames through the mailbox)."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    prefix = "a-rather-long-gradient-name/" * 8
    for step in range(3):
        hs = [hvd.allreduce_async(np.full(3, float(r + i)), op=hvd.Sum, name=f"{prefix}{i}")
              for i in range(3000)]
        for i, h in enumerate(hs):
            got = h.wait()
            assert got[0] == sum(q + i for q in range(n)), (step, i, got)
    hvd.shutdown()
    return "ok"


def threads_waiting() -> str:
    """Several threads submit and wait at once: only one drives a round at a time and
    every collective still runs in the agreed order."""
    import threading

    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(200):
                size = 70_000 if i % 25 == 0 else 3  # now and then the data plane too
                got = hvd.allreduce(np.full(size, float(r + t + i), np.float32), op=hvd.Sum,
                                    name=f"t{t}.{i}")
                assert got[0] == sum(q + t + i for q in range(n)), (t, i, got[0])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    hvd.shutdown()
    if errors:
        raise errors[0]
    return "ok"


def at_scale() -> tuple:
    """The collectives that negotiation through the coordinator must get right at any
    size: small (inline) and large allreduces, allgather with uneven rows, broadcast
    from the last rank, alltoall, a process set of the odd ranks, a shape mismatch
    (typed error on every rank), a join with uneven work. Returns how rounds went
    ("star", "tree" or "all-to-all") and "ok"."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    for i in range(20):  # steady state: the cached, inline path
        got = hvd.allreduce(np.array([r + i], np.float32), op=hvd.Sum, name="small")
        assert got[0] == n * i + n * (n - 1) / 2, got
    # how rounds go, read while every rank is in (a round after a peer's shutdown goes
    # through the star: exchange._end_tree)
    ex = hvd._api.runtime().engine.exchange
    mode = "tree" if ex.over_tree else "star" if ex.coordinated else "all-to-all"
    big = hvd.allreduce(np.full(300_007, r, np.float64), op=hvd.Sum, name="big")
    assert np.all(big == n * (n - 1) / 2)
    rows = hvd.allgather(np.full((r + 1, 2), r, np.int32), name="rows")
    assert rows.shape == (n * (n + 1) // 2, 2)
    assert [int(v) for v in rows[:, 0]] == [k for k in range(n) for _ in range(k + 1)]
    b = hvd.broadcast(np.array([r * 10]), root_rank=n - 1, name="b")
    assert b[0] == (n - 1) * 10
    a2a = hvd.alltoall(np.arange(n, dtype=np.int64) + 100 * r, name="a2a")
    assert [int(v) for v in a2a] == [100 * k + r for k in range(n)]
    odd = hvd.add_process_set([k for k in range(n) if k % 2])
    if r % 2:
        s = hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="odd", process_set=odd)
        assert s[0] == n // 2
    try:
        hvd.allreduce(np.ones(5 if r == n - 1 else 4, np.float32), name="mismatched")
    except hvd.TensorMismatchError as exc:
        assert f"rank {n - 1} sent float32[5]" in str(exc), exc
    else:
        raise AssertionError("no mismatch error")
    for step in range(r + 1):  # uneven batches
        hvd.allreduce(np.ones(3), name="uneven")
    last = hvd.join()
    assert last == n - 1, last
    hvd.shutdown()
    return mode, "ok"


def connections_on_demand() -> tuple:
    """Which sockets a job under the coordinator holds (transport/mesh.py): after
    ``init()`` only the control sockets to rank 0; after a ring allreduce the data
    sockets of its two ring neighbours; after an alltoall one to every peer. Returns
    (control sockets, data sockets after the ring, after the alltoall)."""
    import ronde as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mesh = hvd._api.runtime().mesh
    ctl, data0 = len(mesh.ctl), len(mesh.data)
    assert data0 == 0, data0
    big = hvd.allreduce(np.full(300_007, r, np.float64), op=hvd.Sum, name="ring")
    assert np.all(big == n * (n - 1) / 2)
    ring = sorted(mesh.data)
    rows = hvd.allgather(np.full((r + 1, 2), r, np.int32), name="rows")  # Bruck's, tcp
    assert [int(v) for v in rows[:, 0]] == [k for k in range(n) for _ in range(k + 1)]
    a2a = hvd.alltoall(np.arange(n, dtype=np.int64) + 100 * r, name="a2a")
    assert [int(v) for v in a2a] == [100 * k + r for k in range(n)]
    every = sorted(mesh.data)
    hvd.shutdown()
    return ctl, ring, every


def timeline_training_steps() -> int:
    """Six training-like steps (compute, then three gradients allreduced), rank 1
    computing 30 ms longer each step (the late rank), under RONDE_TIMELINE."""
    import ronde as hvd

    hvd.init()
    grads = [np.ones(20_000 * 10 ** i, np.float32) for i in range(3)]  # 80 KB .. 8 MB
    for step in range(6):
        time.sleep(0.01 + (0.03 if hvd.rank() == 1 else 0.0))  # "compute"
        hs = [hvd.allreduce_async(g, name=f"grad.{i}") for i, g in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)
    time.sleep(0.3)  # events reach the file at least every 0.1 s
    hvd.shutdown()
    return 0


def adasum_cases() -> str:
    """Adasum against the numpy reference tree (``collectives/adasum.py``), on every
    rank, in fp16/32/64; orthogonal inputs sum, parallel ones average; fused equals
    unfused; tiny and huge magnitudes stay finite; reducescatter and integers refused."""
    import ronde as hvd
    from ronde.collectives import adasum

    hvd.init()
    r, n = hvd.rank(), hvd.size()

    def contribution(rank, length, seed):
        return np.random.default_rng(seed * 100 + rank).standard_normal(length)

    for dt, tol in ((np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 2e-2)):
        for length in (1, 17, 5000):
            x = contribution(r, length, length).astype(dt)
            got = hvd.allreduce(x, op=hvd.Adasum, name=f"ada.{dt.__name__}.{length}")
            want = adasum.tree([contribution(k, length, length).astype(dt).astype(np.float64)
                                for k in range(n)])
            assert got.dtype == dt and got.shape == x.shape
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    # orthogonal: the sum; parallel (the same vector everywhere): the mean (= it)
    e = np.zeros(n * 2)
    e[r * 2] = r + 1.0
    np.testing.assert_allclose(hvd.allreduce(e, op=hvd.Adasum, name="ortho"),
                               np.repeat(np.arange(1.0, n + 1), 2) * (np.arange(2 * n) % 2 == 0))
    same = np.linspace(-1, 1, 9)
    np.testing.assert_allclose(hvd.allreduce(same, op=hvd.Adasum, name="parallel"), same)
    # fused (three async, one round) equals unfused (one at a time)
    parts = [contribution(r, m, m + 1) for m in (3, 40, 7)]
    hs = [hvd.allreduce_async(p, op=hvd.Adasum, name=f"fused.{i}") for i, p in enumerate(parts)]
    fused = [hvd.synchronize(h) for h in hs]
    alone = [hvd.allreduce(p, op=hvd.Adasum, name=f"alone.{i}") for i, p in enumerate(parts)]
    for a, b in zip(fused, alone):
        np.testing.assert_array_equal(a, b)
    # magnitudes: no overflow in the dot products (taken in float64), no 0/0
    for scale in (1e-30, 1e30):
        big = (contribution(r, 64, 9) * scale).astype(np.float32)
        assert np.all(np.isfinite(hvd.allreduce(big, op=hvd.Adasum, name=f"mag.{scale}")))
    assert np.all(hvd.allreduce(np.zeros(8), op=hvd.Adasum, name="zeros") == 0)
    for bad in (lambda: hvd.reducescatter(np.ones(2 * n), op=hvd.Adasum, name="rs"),
                lambda: hvd.allreduce(np.ones(3, np.int32), op=hvd.Adasum, name="ints")):
        try:
            bad()
        except (hvd.UnsupportedError, ValueError) as exc:
            assert "Adasum" in str(exc), exc
        else:
            raise AssertionError("Adasum accepted where it must be refused")
    hvd.shutdown()
    return "ok"


def torch_adasum_optimizer(same_data: bool) -> list:
    """The Adasum delta optimizer: parameters equal on every rank after each step; with
    the same batch everywhere (parallel deltas) a step equals one process's step."""
    import torch

    import ronde.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    reference = torch.nn.Linear(6, 2)
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(step if same_data else step * 10 + hvd.rank())
        x = torch.randn(8, 6, generator=gen)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        everyone = hvd.allgather(flat.unsqueeze(0), name=f"params.{step}")
        assert torch.equal(everyone[0], everyone[-1]), "parameters differ across ranks"
        if same_data:
            ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
            assert torch.allclose(flat, ref, atol=1e-6), (flat, ref)
    hvd.shutdown()
    return [float(v) for v in flat[:3]]


def adasum_bindings() -> str:
    """op=Adasum through the JAX and TensorFlow bindings' allreduce."""
    import ronde
    from ronde.collectives import adasum

    ronde.init()
    r, n = ronde.rank(), ronde.size()
    vals = [np.arange(5.0) * (k + 1) + k * np.array([1, -1, 1, -1, 1]) for k in range(n)]
    want = adasum.tree(vals)
    import jax.numpy as jnp

    import ronde.jax as hj

    got = hj.allreduce(jnp.asarray(vals[r], jnp.float32), op=hj.Adasum, name="jax.ada")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)
    import tensorflow as tf

    import ronde.tensorflow as ht

    got = ht.allreduce(tf.constant(vals[r], tf.float32), op=ht.Adasum, name="tf.ada")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5)
    ronde.shutdown()
    return "ok"


def autotuned_training(steps: int) -> tuple:
    """Training-like steps under RONDE_AUTOTUNE (small samples): every result exact;
    returns the values applied on this rank, each with its round, and rank 0's verdict."""
    import ronde as hvd
    from ronde import _state

    hvd.init()
    n = hvd.size()
    grads = [np.full(256 * 4 ** i, float(hvd.rank() + 1), np.float32) for i in range(6)]
    for step in range(steps):
        time.sleep(0.002)  # "compute"
        hs = [hvd.allreduce_async(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for g, h in zip(grads, hs):
            out = hvd.synchronize(h)
            assert out.shape == g.shape and np.all(out == n * (n + 1) / 2), (step, out[:3])
    engine = _state.require().engine
    tuner = engine.autotune.tuner
    verdict = None if tuner is None else (tuner.done, len(tuner.samples))
    for _ in range(3):  # a last proposal reaches every rank
        hvd.allreduce(np.ones(2), name="settle")
    hvd.barrier()
    history = [(rnd, tuple(t)) for rnd, t in engine.autotune.history]
    final = (engine.negotiator.fusion_threshold_bytes, engine.cycle_s,
             engine.announcer.inline_bytes, engine.exchange.spin_s)
    hvd.shutdown()
    return history, final, verdict


def jax_adasum_optimizer() -> str:
    """ronde.jax.DistributedOptimizer(optax.sgd, op=Adasum): the combined update is the
    reference tree of the ranks' deltas, leaf by leaf, eagerly and under jit; the
    parameters stay equal on every rank."""
    import jax
    import jax.numpy as jnp
    import optax

    import ronde.jax as hj
    from ronde.collectives import adasum

    hj.init()
    r, n = hj.rank(), hj.size()
    lr = 0.1
    grads = {k: [np.arange(1.0, 4.0 + i) * (j + 1) + j * (-1.0) ** np.arange(3 + i)
                 for j in range(n)] for i, k in enumerate(("a", "b"))}
    params = {"a": jnp.full(3, 0.5, jnp.float32), "b": jnp.zeros(4, jnp.float32)}
    tx = hj.DistributedOptimizer(optax.sgd(lr), op=hj.Adasum)
    state = tx.init(params)
    mine = {k: jnp.asarray(v[r], jnp.float32) for k, v in grads.items()}
    want = {k: np.asarray(params[k]) + adasum.tree([-lr * g for g in v])
            for k, v in grads.items()}  # per leaf: not one fused buffer
    updates, state = tx.update(mine, state, params)
    eager = optax.apply_updates(params, updates)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    jitted, _ = step(params, state, mine)
    for k in want:
        np.testing.assert_allclose(np.asarray(eager[k]), want[k], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(jitted[k]), want[k], rtol=1e-5)
    try:
        hj.DistributedOptimizer(optax.sgd(lr), op=hj.Adasum, backward_passes_per_step=2)
        raise AssertionError("accumulating passes with Adasum must be refused")
    except ValueError as exc:
        assert "backward_passes_per_step" in str(exc)
    hj.shutdown()
    return "ok"


def held_rounds(steps: int) -> tuple:
    """Steps of one allreduce whose ranks arrive apart (rank ``k % n`` 5 ms late in step
    k); then a collective completed by a rank whose peers announced it in an earlier
    round (they want no round: only the completion may start it), once with each rank
    late. Returns (same-host mailboxes in use, rounds the steps took, rounds the
    completions took)."""
    import ronde as hvd
    from ronde import _state

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    eng = _state.require().engine
    want = np.full(3, float(n * (n + 1) // 2))
    for _ in range(2):  # the names enter the response cache (new names are never held)
        np.testing.assert_array_equal(hvd.allreduce(np.full(3, r + 1.0), op=hvd.Sum,
                                                    name="g"), want)
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
    # the counts are read between held rounds (cached names): no rank can start the
    # next round before every rank read them
    before = eng._rounds
    for k in range(steps):
        if r == k % n:
            time.sleep(0.005)
        np.testing.assert_array_equal(hvd.allreduce(np.full(3, r + 1.0), op=hvd.Sum,
                                                    name="g"), want)
    rounds = eng._rounds - before
    before = eng._rounds
    for late in range(n):
        if r != late:
            h = hvd.allreduce_async(np.full(3, r + 1.0), op=hvd.Sum, name="g")
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
        else:
            time.sleep(0.01)
            hvd.allreduce(np.ones(1), op=hvd.Sum, name="x")
            time.sleep(0.01)
            h = hvd.allreduce_async(np.full(3, r + 1.0), op=hvd.Sum, name="g")
        np.testing.assert_array_equal(hvd.synchronize(h), want)
    completions = eng._rounds - before
    hvd.allreduce(np.full(3, r + 1.0), op=hvd.Sum, name="g")
    if n >= 3:
        # a process set {0, 1}: rank 2's "z" went out with "w", so it wants no round
        # while ranks 0 and 1 loop on "p"; both members want theirs, so it starts
        ps = hvd.add_process_set([0, 1])
        hz = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="z") if r == 2 else None
        hvd.allreduce(np.ones(1), op=hvd.Sum, name="w")
        if r in (0, 1):
            for _ in range(4):
                got = hvd.allreduce(np.ones(2), op=hvd.Sum, name="p", process_set=ps)
                np.testing.assert_array_equal(got, np.full(2, 2.0))
            hz = hvd.allreduce_async(np.ones(1), op=hvd.Sum, name="z")
        np.testing.assert_array_equal(hvd.synchronize(hz), np.full(1, float(n)))
    mailboxes = eng.exchange.mailboxes is not None
    hvd.shutdown()
    return mailboxes, rounds, completions


def inplace_allgather() -> str:
    """tests/torch/sharded_workers.py's: an allgather whose input is this rank's own block
    of its output (ShardedOptimizer's flat parameters)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "torch"))
    import sharded_workers

    return sharded_workers.inplace_allgather()
