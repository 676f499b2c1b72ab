"""Waits on shm counters sleep on a futex and are woken by the owner's publish; with
more members than cores they never poll; a sleeping wait still sees the engine's abort."""

from __future__ import annotations

import mmap
import threading
import time

import pytest

from ronde.transport import futex
from ronde.transport.shm import counters as counters_mod
from ronde.transport.shm.counters import Counters
from ronde.transport.shm.protocol import HEADER_BYTES, SLEEPERS_OFFSET, WRITTEN

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not futex.AVAILABLE, reason="no futex here")]


def _pair(aborted=lambda: None):
    maps = [mmap.mmap(-1, HEADER_BYTES), mmap.mmap(-1, HEADER_BYTES)]
    return maps, Counters(maps, 0, [0, 1], lambda: None), Counters(maps, 1, [0, 1], aborted)


def _mark(maps, owner, member):
    """The word ``member`` writes in ``owner``'s sleepers table."""
    import numpy as np

    return int(np.frombuffer(maps[owner], dtype=np.int64, count=1,
                             offset=SLEEPERS_OFFSET + 8 * member)[0])


def _until(cond):
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


def test_a_sleeping_wait_is_woken_by_the_publish_and_clears_its_mark():
    maps, owner, waiter = _pair()
    waiter.oversubscribed = True  # straight to the futex
    done = threading.Event()
    t = threading.Thread(target=lambda: (waiter.wait_for(0, WRITTEN, 1), done.set()))
    t.start()
    _until(lambda: _mark(maps, 0, 1) == WRITTEN + 1)  # asleep on rank 0's WRITTEN
    assert not done.is_set()
    owner.publish(WRITTEN, 1)
    t.join(10)
    assert done.is_set() and _mark(maps, 0, 1) == 0


def test_with_more_members_than_cores_a_wait_never_polls(monkeypatch):
    maps, owner, waiter = _pair()
    waiter.oversubscribed = True
    yields = []
    monkeypatch.setattr(counters_mod.os, "sched_yield", lambda: yields.append(1))
    t = threading.Thread(target=waiter.wait_for, args=(0, WRITTEN, 1))
    t.start()
    _until(lambda: _mark(maps, 0, 1) == WRITTEN + 1)
    owner.publish(WRITTEN, 1)
    t.join(10)
    assert not t.is_alive() and yields == []


def test_a_sleeping_wait_raises_the_engines_failure():
    failure = []
    maps, owner, waiter = _pair(lambda: failure[0] if failure else None)
    waiter.oversubscribed = True
    raised = []

    def wait():
        try:
            waiter.wait_for(0, WRITTEN, 1)
        except RuntimeError as exc:
            raised.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    _until(lambda: _mark(maps, 0, 1) == WRITTEN + 1)
    failure.append(RuntimeError("peer lost"))
    t.join(10)
    assert [str(e) for e in raised] == ["peer lost"] and _mark(maps, 0, 1) == 0


def test_a_publish_nobody_waits_for_makes_no_system_call(monkeypatch):
    maps, owner, waiter = _pair()
    woken = []
    monkeypatch.setattr(counters_mod.futex, "wake", lambda addr: woken.append(addr))
    owner.publish(WRITTEN, 5)
    assert woken == [] and waiter.headers[0][WRITTEN] == 5


def test_a_wait_polls_only_while_someone_waits_for_the_result(monkeypatch):
    # urgent() false (a gradient bucket's allreduce while backward runs): no sched_yield
    # polling, straight to the futex after the spin; urgent, or told nothing: polls
    maps = [mmap.mmap(-1, HEADER_BYTES), mmap.mmap(-1, HEADER_BYTES)]
    owner = Counters(maps, 0, [0, 1], lambda: None)
    urgent = [False]
    waiter = Counters(maps, 1, [0, 1], lambda: None, urgent=lambda: urgent[0])
    waiter.oversubscribed = False
    yields = []
    monkeypatch.setattr(counters_mod.os, "sched_yield", lambda: yields.append(1))
    for t, flag in ((1, False), (2, True)):
        urgent[0] = flag
        th = threading.Thread(target=waiter.wait_for, args=(0, WRITTEN, t))
        th.start()
        time.sleep(0.05)  # past the poll window (2 ms) either way
        owner.publish(WRITTEN, t)
        th.join(10)
        assert (len(yields) > 0) == flag, (flag, len(yields))
        yields.clear()
    # and a wait told not to poll (the steady lane's meeting) does not, urgent or not
    th = threading.Thread(target=waiter.wait_for, args=(0, WRITTEN, 3, False))
    th.start()
    time.sleep(0.05)
    owner.publish(WRITTEN, 3)
    th.join(10)
    assert not yields


def test_a_long_wait_warns_once_naming_the_rank_it_waits_for(caplog):
    maps = [mmap.mmap(-1, HEADER_BYTES), mmap.mmap(-1, HEADER_BYTES)]
    owner = Counters(maps, 0, [4, 7], lambda: None)
    waiter = Counters(maps, 1, [4, 7], lambda: None, stall_warn_s=0.1)
    waiter.oversubscribed = True
    th = threading.Thread(target=waiter.wait_for, args=(0, WRITTEN, 1))
    with caplog.at_level("WARNING", logger="ronde.transport.shm.counters"):
        th.start()
        time.sleep(0.4)  # several sleep checks past the threshold: one warning
        owner.publish(WRITTEN, 1)
        th.join(10)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "rank 7 has waited" in warned[0] \
        and "for rank 4" in warned[0], warned
