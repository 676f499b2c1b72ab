"""Rank functions for tests/integration/test_steady_lane.py (core/lane.py).

Each scenario starts ronde, makes two gradient-bucket names (``.bucket<k>.<n>``) enter
the steady lane (two agreed steps), does one thing, checks the values against what a
sum over the ranks must give, and shuts ronde down: a broken lane stays broken, so each
scenario gets a fresh engine. Arrays are above the inline size (4 KiB), one of them
above the single-copy size (256 KiB), so both shared-memory data paths run.
"""

from __future__ import annotations

import time

import numpy as np

SMALL, LARGE = 3000, 100_000  # float64 elements: 24 KB (staged), 800 KB (single copy)
NAMES = (("m.bucket0.3", SMALL), ("m.bucket1.7", LARGE))


def _start() -> tuple:
    import ronde as hvd
    from ronde import _state

    hvd.init()
    return hvd, hvd.rank(), hvd.size(), _state.require().engine.lane


def _step(hvd, r: int, step: int, order=NAMES, sizes=None) -> list:
    """One step: every bucket started, then waited for, as DistributedOptimizer does;
    each rank brings ``r + 1 + step``."""
    handles = [hvd.allreduce_async(np.full((sizes or {}).get(name, size), r + 1.0 + step),
                                   op=hvd.Sum, name=name) for name, size in order]
    return [h.wait() for h in handles]


def _expect(n: int, step: int) -> float:
    return n * (n + 1) / 2 + n * step


def _warm(hvd, r: int, n: int, lane) -> None:
    for step in range(2):  # two agreements: both names enter
        for got in _step(hvd, r, step):
            np.testing.assert_array_equal(got, _expect(n, step))
    assert set(lane.table) == {name for name, _ in NAMES}, lane.table


def steady() -> dict:
    """Steps through the lane: exact sums, an Average, no round for them, no break."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    from ronde import _state

    eng = _state.require().engine
    rounds = eng._rounds
    for step in range(2, 8):
        for got in _step(hvd, r, step):
            np.testing.assert_array_equal(got, _expect(n, step))
    out = {"laned": lane.laned, "breaks": lane.breaks, "rounds": eng._rounds - rounds}
    hvd.shutdown()
    return out


def swapped() -> dict:
    """Odd ranks start the buckets in the other order: every rank breaks at the same
    meeting and the general path reduces both, exactly; two steps later the lane is
    back (a new epoch)."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    order = NAMES[::-1] if r % 2 else NAMES
    got = _step(hvd, r, 2, order)
    for g in got:
        np.testing.assert_array_equal(g, _expect(n, 2))
    # the swapped step's buckets, negotiated, were the first agreement of a new epoch;
    # the next step enters both names again, the two after it take the lane
    for step in range(3, 6):
        for g in _step(hvd, r, step):
            np.testing.assert_array_equal(g, _expect(n, step))
    out = {"laned": lane.laned, "breaks": lane.breaks, "epoch": lane.epoch}
    hvd.shutdown()
    return out


def changed_shape() -> dict:
    """The last rank's first bucket grows by one element: every rank gets the general
    path's TensorMismatchError for it (the lane broke), the other bucket is reduced,
    and the engine goes on."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    sizes = {"m.bucket0.3": SMALL + 1} if r == n - 1 else None
    handles = [hvd.allreduce_async(np.full(sizes.get(name, size) if sizes else size, 1.0),
                                   op=hvd.Sum, name=name) for name, size in NAMES]
    errors = []
    for h in handles:
        try:
            np.testing.assert_array_equal(h.wait(), float(n))
        except hvd.TensorMismatchError as exc:
            errors.append(str(exc))
    later = hvd.allreduce(np.full(SMALL, 1.0), op=hvd.Sum, name="m.bucket0.3")
    np.testing.assert_array_equal(later, float(n))
    out = {"errors": errors, "breaks": lane.breaks}
    hvd.shutdown()
    return out


def interleaved() -> dict:
    """A negotiated collective started around a lane one in a different order on
    different ranks: neither waits for the other (the lane has its own thread and
    communicator)."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    before = lane.laned
    for step in range(2, 5):
        other = lambda: hvd.allreduce_async(np.full(5000, float(r)), op=hvd.Sum,  # noqa: E731
                                            name=f"metric.{step}")
        if r % 2:
            hx = other()
            got = _step(hvd, r, step)
        else:
            handles = [hvd.allreduce_async(np.full(size, r + 1.0 + step), op=hvd.Sum,
                                           name=name) for name, size in NAMES]
            hx = other()
            got = [h.wait() for h in handles]
        np.testing.assert_array_equal(hx.wait(), float(n * (n - 1) / 2))
        for g in got:
            np.testing.assert_array_equal(g, _expect(n, step))
    out = {"laned": lane.laned - before, "breaks": lane.breaks}
    hvd.shutdown()
    return out


def joined() -> dict:
    """The last rank joins while the others run a step: they break at that meeting and
    the general path reduces with the joined rank's zeros, as without the lane; the
    next epoch's steps take the lane again."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    if r == n - 1:
        hvd.join()
        got = None
    else:
        got = [float(g[0]) for g in _step(hvd, r, 2)]
        hvd.join()
    broken = lane.broken
    # the next epoch of training: its first step's agreement starts the lane's next
    # epoch (the join step's had a joined rank), the second enters, the third is laned
    for step in range(3, 6):
        for g in _step(hvd, r, step):
            np.testing.assert_array_equal(g, _expect(n, step))
    out = {"got": got, "breaks": lane.breaks, "broken": broken, "laned": lane.laned,
           "epoch": lane.epoch}
    hvd.shutdown()
    return out


def resident() -> dict:
    """Buckets in the lane's shared memory (``_api.bucket_memory``, where torch's live):
    reduced where they lie, to the bits of the general path (an Average of random
    values, against a negotiated allreduce of a copy); a step where odd ranks bring a
    bucket that lies elsewhere, and one where they do not reduce it in place, take the
    general data path on every rank, exactly."""
    hvd, r, n, lane = _start()
    from ronde import _api

    rng = np.random.default_rng(r)
    big = _api.bucket_memory(LARGE * 8).view(np.float64)  # the same place on every rank
    small = _api.bucket_memory(SMALL * 8).view(np.float64)
    elsewhere = _api.bucket_memory(LARGE * 8).view(np.float64)
    exact = []
    for step in range(7):
        moved, apart = step == 5 and r % 2 == 1, step == 6 and r % 2 == 1
        bufs = (("r.bucket0.2", elsewhere if moved else big), ("r.bucket1.5", small))
        for _, buf in bufs:
            buf[:] = rng.standard_normal(buf.size)
        want = [hvd.allreduce(buf.copy(), op=hvd.Average, name=f"check.{step}.{name}")
                for name, buf in bufs]
        handles = [hvd.allreduce_async(buf, op=hvd.Average, name=name,
                                       out=None if apart and k == 0 else buf)
                   for k, (name, buf) in enumerate(bufs)]
        for h, w, (_, buf) in zip(handles, want, bufs):
            got = h.wait()
            exact.append((got is buf or apart) and bool(np.array_equal(got, w)))
    out = {"exact": all(exact), "laned": lane.laned, "resident": lane.resident,
           "breaks": lane.breaks}
    hvd.shutdown()
    return out


def late() -> dict:
    """Rank 0 reaches a step 0.3 s after the others: they wait at the meeting, nothing
    breaks, the sums are exact."""
    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    for step in range(2, 4):
        if r == 0:
            time.sleep(0.3)
        for g in _step(hvd, r, step):
            np.testing.assert_array_equal(g, _expect(n, step))
    out = {"laned": lane.laned, "breaks": lane.breaks}
    hvd.shutdown()
    return out


def lane_state() -> dict:
    """Four steps; whether the lane is on, what it ran, how many names it holds."""
    hvd, r, n, lane = _start()
    for step in range(4):
        for g in _step(hvd, r, step):
            np.testing.assert_array_equal(g, _expect(n, step))
    out = {"enabled": lane.enabled, "laned": lane.laned, "table": len(lane.table)}
    hvd.shutdown()
    return out


def timeline(path: str) -> dict:
    """A timeline of steps through the lane: each bucket's QUEUE, its meeting as
    NEGOTIATE (marked ``steady_lane``) and its ALLREDUCE, and a summary with a
    communication figure per step (the lane recorded nothing once: every figure 0)."""
    from ronde.core.timeline import load
    from ronde.timeline import summarize

    hvd, r, n, lane = _start()
    _warm(hvd, r, n, lane)
    mine = path.format(rank=r)
    hvd.start_timeline(path)  # {rank} in the path: every rank writes its own
    for step in range(2, 6):
        _step(hvd, r, step)
    hvd.stop_timeline()
    laned = lane.laned
    hvd.shutdown()
    events = [e for e in load(mine) if e.get("ph") == "X"]
    phases = sorted({(e["name"], bool((e.get("args") or {}).get("steady_lane")))
                     for e in events})
    comm = summarize([mine])["stats"][r]["communication"]["p50_us"]
    return {"laned": laned, "phases": phases, "comm_p50_positive": comm > 0}
