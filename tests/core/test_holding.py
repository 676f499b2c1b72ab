"""Holding a round back (core/holding.py, ``RONDE_ROUND_HOLD``), threads as ranks.

Four engines in one process talk through a coordinator (no same-host mailboxes between
threads), so this is the coordinator's hold; the mailboxes' ``WANT`` word is tested
with real processes in tests/integration/test_round_hold.py. The hold deadline is set
to a minute here: a round held that should have started would show as a hang (the
tests' timeout), never as a slower pass.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ronde import TensorMismatchError
from ronde.collectives.ops import ReduceOp
from ronde.core.requests import Kind, Request

pytestmark = pytest.mark.timeout(60)
#: a minute of hold. Callers drive their engines (a handle drives its own rank's: with a
#: registry per process, a thread waiting on its handle drove another rank's engine, and
#: could sit in that rank's round while its own rank was the one the round waited for)
HOLD = {"round_hold_ms": 60_000.0}


def _ar(name: str, arr: np.ndarray, **kw) -> Request:
    return Request(Kind.ALLREDUCE, name, arr, op=ReduceOp.SUM, **kw)


def _steps(g, steps: int, late: int, late_s: float = 0.004) -> list[list[np.ndarray]]:
    """Every rank runs ``steps`` steps of one allreduce ("a"); in step k the rank
    ``(k + late) % n`` reaches it ``late_s`` after the others (a slow backward)."""
    n = len(g.engines)
    out: list[list[np.ndarray]] = [[] for _ in range(n)]

    def rank(r: int) -> None:
        eng = g.engines[r]
        for k in range(steps):
            if r == (k + late) % n:
                time.sleep(late_s)
            out[r].append(eng.submit(_ar("a", np.full(3, r + 1.0))).handle.wait(30))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads)
    return out


def _process_set(g, ranks: list[int]) -> int:
    """A process set of ``ranks``, added on every engine; its id."""
    add = [eng.request_process_set("add", ranks, Request(Kind.BARRIER,
                                                         f"process_set.add.{ranks}", None))
           for eng in g.engines]
    (ps,) = {r.handle.wait(10) for r in add}
    return ps


def _rounds(g) -> int:
    counts = {e._rounds for e in g.engines}
    assert len(counts) == 1, counts  # every rank took part in every round
    return counts.pop()


@pytest.mark.parametrize("hold_ms", [60_000.0, 0.0])
def test_a_step_whose_ranks_arrive_apart_is_agreed_in_one_round(engines, hold_ms):
    # whichever rank is late (the coordinator included), the others' announcements wait
    # for it: one round a step. Without the hold (RONDE_ROUND_HOLD=0, Horovod's way)
    # every early rank's announcement starts a round of its own
    import sys

    g = engines(4, round_hold_ms=hold_ms)
    _steps(g, 2, 0)  # the names enter the response cache (new names are never held)
    before = _rounds(g)
    # the coordinator looks again at each member frame that arrives: it reads each
    # member's frame once a round all the same (it decoded every buffered frame at
    # every look: at np=8 a third of its control thread's Python calls)
    decoder = g.engines[0].exchange.channels.decoder
    unpack, looked = decoder.unpack, []

    def counting(payload, r):
        if sys._getframe(1).f_code.co_filename.endswith("holding.py"):
            looked.append(r)
        return unpack(payload, r)

    decoder.unpack = counting
    got = _steps(g, 8, 1)
    del decoder.unpack
    for per_rank in got:
        for x in per_rank:
            np.testing.assert_array_equal(x, np.full(3, 10.0))
    rounds = _rounds(g) - before
    if hold_ms:
        assert rounds == 8, rounds
        assert len(looked) <= 3 * rounds, looked
    else:
        assert rounds > 8, rounds  # what the hold saves (the test can fail)


def test_announcements_that_complete_a_collective_are_never_held(engines):
    # the early ranks' "a" went out in an earlier round (with "x", which the late rank
    # completed); they have nothing new to say, so they never want another round. The
    # late rank's "a" completes it: its round starts at once even with a minute of hold
    # (a hold here would hang the test), whether the late one is the coordinator (rank
    # 0) or a member
    g = engines(4, **HOLD)
    _steps(g, 2, 0)
    for late in range(4):
        hs_a = [None] * 4
        hs_x = []
        for r in range(4):
            if r != late:
                hs_a[r] = g.engines[r].submit(_ar("a", np.full(3, r + 1.0))).handle
                hs_x.append(g.engines[r].submit(_ar("x", np.ones(2))).handle)
        time.sleep(0.01)
        hs_x.append(g.engines[late].submit(_ar("x", np.ones(2))).handle)
        for h in hs_x:
            np.testing.assert_array_equal(h.wait(30), np.full(2, 4.0))
        time.sleep(0.01)
        hs_a[late] = g.engines[late].submit(_ar("a", np.full(3, late + 1.0))).handle
        for h in hs_a:
            np.testing.assert_array_equal(h.wait(30), np.full(3, 10.0))


def test_a_process_set_without_the_coordinator_is_not_held_by_it(engines):
    g = engines(4, **HOLD)
    ps = _process_set(g, [2, 3])
    for _ in range(4):  # from the second time on, by cache id: the hold looks at them
        hs = [g.engines[r].submit(_ar("s", np.full(3, float(r)), ps_id=ps)).handle
              for r in (2, 3)]
        for h in hs:
            np.testing.assert_array_equal(h.wait(30), np.full(3, 5.0))


def test_a_member_whose_frame_went_out_first_counts_as_wanting_the_round(engines):
    # set {0, 1} of 3 ranks: rank 1 announces "y" then "x", the coordinator (rank 0)
    # "x" then "y". Rank 1's frame holds only "y" (sent, it cannot add "x" to it) and
    # the coordinator's only "x": neither completes anything, and rank 2 wants nothing.
    # Both members of the set want the round: it starts (held, rank 1 would wait for
    # the coordinator and the coordinator for rank 1's "x": a hang here)
    g = engines(3, **HOLD)
    ps = _process_set(g, [0, 1])
    for rep in range(4):  # from the second time on by cache id, which the hold reads
        order = {0: ("x", "y"), 1: ("y", "x")}
        hs = []
        for r in (1, 0):
            for name in order[r]:
                hs.append(g.engines[r].submit(_ar(name, np.full(2, r + 1.0), ps_id=ps)).handle)
                if r == 1:
                    time.sleep(0.005)  # its "y" goes out alone
        for h in hs:
            np.testing.assert_array_equal(h.wait(30), np.full(2, 3.0))


def test_a_changed_shape_in_a_held_steady_loop_fails_every_rank(engines):
    # what negotiation catches is still caught: the changed tensor is announced by name
    # (its metadata is not the cached one), which is never held
    g = engines(3, **HOLD)
    _steps(g, 3, 0)
    hs = [eng.submit(_ar("a", np.full(4 if r == 1 else 3, 1.0))).handle
          for r, eng in enumerate(g.engines)]
    for h in hs:
        with pytest.raises(TensorMismatchError, match="'a'"):
            h.wait(30)


def test_a_rank_that_never_comes_lets_the_hold_run_out(engines):
    # rank 2 announces nothing for a while: the others' round is held at most
    # RONDE_ROUND_HOLD, then runs (announcing), and the collective completes once
    # rank 2 submits
    g = engines(3, round_hold_ms=20.0)
    _steps(g, 2, 0)
    before = _rounds(g)
    hs = [g.engines[r].submit(_ar("a", np.full(3, 1.0))).handle for r in (0, 1)]
    deadline = time.monotonic() + 30
    while g.engines[2]._rounds == before and time.monotonic() < deadline:
        time.sleep(0.005)  # (rank 2 counts the round once it took part: no hand on it)
    assert g.engines[2]._rounds > before  # the held round ran out and ran without rank 2
    hs.append(g.engines[2].submit(_ar("a", np.full(3, 1.0))).handle)
    for h in hs:
        np.testing.assert_array_equal(h.wait(30), np.full(3, 3.0))
