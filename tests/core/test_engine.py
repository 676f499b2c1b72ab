"""Engine behaviour with threads as ranks (negotiation, order, fusion, validation)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ronde import DuplicateNameError, JoinedError, TensorMismatchError
from ronde.collectives.ops import ReduceOp
from ronde.core import protocol
from ronde.core.communicators import Communicators
from ronde.core.protocol import SILENT, RoundMessage
from ronde.core.requests import Kind, Request
from ronde.transport.ready import Doorbell

pytestmark = pytest.mark.timeout(60)


def ar(name: str, arr: np.ndarray, op: ReduceOp = ReduceOp.SUM, **kw) -> Request:
    return Request(Kind.ALLREDUCE, name, arr, op=op, **kw)


def test_out_of_order_submission_completes_everywhere(engines):
    g = engines(3)
    names = [f"t{i}" for i in range(20)]
    handles = []
    for r, eng in enumerate(g.engines):
        order = names if r % 2 == 0 else list(reversed(names))
        handles.append({n: eng.submit(ar(n, np.full(7, r + 1.0))).handle for n in order})
    for r in range(3):
        for n in names:
            np.testing.assert_array_equal(handles[r][n].wait(10), np.full(7, 6.0))


def test_small_tensors_are_fused(engines):
    g = engines(2, cycle_time_ms=50.0)
    hs = [[eng.submit(ar(f"g{i}", np.ones(3, np.float32))).handle for i in range(30)]
          for eng in g.engines]
    for per_rank in hs:
        for h in per_rank:
            np.testing.assert_array_equal(h.wait(10), np.full(3, 2.0, np.float32))


def test_fused_groups_of_one_round_all_complete(engines):
    # several fused groups agreed in one round follow the first one (Executor._parts):
    # without the single-copy allreduce each still runs on its own, none is lost
    g = engines(2, cycle_time_ms=50.0, fusion_threshold_bytes=40)
    hs = [[eng.submit(ar(f"g{i}", np.full(3, r + 1.0, np.float32))).handle for i in range(30)]
          for r, eng in enumerate(g.engines)]
    for per_rank in hs:
        for h in per_rank:
            np.testing.assert_array_equal(h.wait(10), np.full(3, 3.0, np.float32))


def _announce(neg, rank, names, nbytes_each=12, op=ReduceOp.SUM):
    return RoundMessage(tuple(neg.encode_announcement(
        rank, n, ar(n, np.ones(nbytes_each // 4, np.float32), op).meta()) for n in names))


def test_negotiator_fuses_compatible_tensors_up_to_the_threshold():
    from ronde.core.negotiation import Negotiator

    neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=40, cache_capacity=16)
    names = [f"t{i}" for i in range(7)]
    # rank 1 announces in the opposite order: the agreed order is rank 0's
    out = neg.apply_round([_announce(neg, 0, names), _announce(neg, 1, names[::-1])])
    assert [r.names for r in out] == [names[0:3], names[3:6], names[6:7]]  # 3 x 12 B <= 40 B
    # different ops never share a buffer
    neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=1 << 20, cache_capacity=16)
    msgs = [RoundMessage(_announce(neg, r, ["a"]).announced
                         + _announce(neg, r, ["b"], op=ReduceOp.MAX).announced)
            for r in range(2)]
    assert [r.names for r in neg.apply_round(msgs)] == [["a"], ["b"]]


def test_negotiator_waits_for_every_rank_and_replays_from_cache():
    from ronde.core.negotiation import Negotiator

    neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=1 << 20, cache_capacity=16)
    assert neg.apply_round([_announce(neg, 0, ["x"]), SILENT]) == []
    assert [r.names for r in neg.apply_round([SILENT, _announce(neg, 1, ["x"])])] == [["x"]]
    again = _announce(neg, 0, ["x"])
    assert protocol.encode(again) == {"a": [0]}  # only the cache id travels now
    assert [r.names for r in neg.apply_round([again, _announce(neg, 1, ["x"])])] == [["x"]]


def test_response_cache_announces_ids_on_repeat(engines):
    g = engines(2)
    for step in range(3):
        hs = [eng.submit(ar("w", np.ones(4))).handle for eng in g.engines]
        for h in hs:
            np.testing.assert_array_equal(h.wait(10), np.full(4, 2.0))
        if step == 0:
            assert len(g.engines[0].negotiator.cache) == 1
    raw = g.engines[0].submit  # noqa: F841 - the cache hit path is exercised below
    enc = g.engines[0].negotiator.encode_announcement(
        0, "w", ar("w", np.ones(4)).meta())
    assert isinstance(enc, protocol.ById)


@pytest.mark.parametrize("field", ["shape", "dtype", "op"])
def test_mismatch_fails_every_rank_with_details(engines, field):
    g = engines(3)
    hs = []
    for r, eng in enumerate(g.engines):
        arr = np.ones(4, np.float32)
        op = ReduceOp.SUM
        if r == 1 and field == "shape":
            arr = np.ones(5, np.float32)
        if r == 1 and field == "dtype":
            arr = np.ones(4, np.float16)
        if r == 1 and field == "op":
            op = ReduceOp.MAX
        hs.append(eng.submit(ar("bad", arr, op)).handle)
    for h in hs:
        with pytest.raises(TensorMismatchError, match=r"allreduce 'bad': .*rank 1 sent"):
            h.wait(10)
    # the job stays usable
    hs = [eng.submit(ar("ok", np.ones(2))).handle for eng in g.engines]
    for h in hs:
        np.testing.assert_array_equal(h.wait(10), np.full(2, 3.0))


def test_broadcast_root_mismatch(engines):
    g = engines(2)
    hs = [eng.submit(Request(Kind.BROADCAST, "b", np.ones(3), root=r)).handle
          for r, eng in enumerate(g.engines)]
    for h in hs:
        with pytest.raises(TensorMismatchError, match="root_rank differs"):
            h.wait(10)


def test_duplicate_in_flight_name_is_rejected(engines):
    g = engines(2)
    g.engines[0].submit(ar("dup", np.ones(2)))
    with pytest.raises(DuplicateNameError, match="already in flight"):
        g.engines[0].submit(ar("dup", np.ones(2)))
    g.engines[1].submit(ar("dup", np.ones(2)))


def test_join_contributes_zeros_and_averages_over_the_whole_set(engines):
    # Horovod's rule: a joined rank adds zeros and Average still divides by the set size
    g = engines(3)
    j = g.engines[2].submit(Request(Kind.JOIN, "join.0", None)).handle
    hs = [g.engines[r].submit(ar("x", np.full(2, r + 1.0), op=ReduceOp.AVERAGE)).handle
          for r in range(2)]
    for h in hs:
        np.testing.assert_allclose(h.wait(10), np.full(2, 1.0))
    bad = [g.engines[r].submit(Request(Kind.ALLGATHER, "ag", np.ones((1, 2)))).handle
           for r in range(2)]
    for h in bad:
        with pytest.raises(JoinedError, match="join"):
            h.wait(10)
    js = [g.engines[r].submit(Request(Kind.JOIN, "join.0", None)).handle for r in range(2)]
    last = [h.wait(10) for h in js + [j]]
    assert len(set(last)) == 1 and last[0] in (0, 1)


def test_disjoint_process_sets_run_independently(engines):
    g = engines(4)
    add = [eng.request_process_set("add", ranks, Request(Kind.BARRIER,
                                                         f"process_set.add.{ranks}", None))
           for eng, ranks in zip(g.engines, ([0, 1], [0, 1], [0, 1], [0, 1]))]
    ids = {r.handle.wait(10) for r in add}
    add2 = [eng.request_process_set("add", [2, 3], Request(Kind.BARRIER,
                                                           "process_set.add.[2, 3]", None))
            for eng in g.engines]
    ids2 = {r.handle.wait(10) for r in add2}
    (a,), (b,) = ids, ids2
    # ranks 2,3 complete in set b although ranks 0,1 never submit anything there
    hs = [g.engines[r].submit(ar("s", np.full(3, float(r)), ps_id=b)).handle for r in (2, 3)]
    for h in hs:
        np.testing.assert_array_equal(h.wait(10), np.full(3, 5.0))
    hs = [g.engines[r].submit(ar("s", np.full(3, float(r)), ps_id=a)).handle for r in (0, 1)]
    for h in hs:
        np.testing.assert_array_equal(h.wait(10), np.full(3, 1.0))


def test_a_process_set_agreed_while_data_moves_waits_for_it_and_a_failed_one_is_told(engines):
    # issue #34: the dispatcher resolves each response's communicator where it hands it
    # out, so a set change runs there once everything agreed before it has run. Data in
    # flight on the global set completes around an added set; a communicator that cannot
    # be built fails the add on every rank (it used to leave the request pending forever:
    # the executor logged the error and went on) and stops the engine
    from ronde import RendezvousError

    g = engines(3)
    hs = [[eng.submit(ar(f"d{i}", np.full(1 << 14, r + 1.0))).handle for i in range(6)]
          for r, eng in enumerate(g.engines)]
    add = [eng.request_process_set("add", [0, 1], Request(Kind.BARRIER,
                                                          "process_set.add.[0, 1]", None))
           for eng in g.engines]
    after = [eng.submit(ar("after", np.full(3, r + 1.0))).handle
             for r, eng in enumerate(g.engines)]
    for per_rank in hs:
        for h in per_rank:
            np.testing.assert_array_equal(h.wait(10), np.full(1 << 14, 6.0))
    (ps,) = {r.handle.wait(10) for r in add}
    for h in after:
        np.testing.assert_array_equal(h.wait(10), np.full(3, 6.0))
    hs = [eng.submit(ar("in.set", np.full(3, r + 1.0), ps_id=ps)).handle
          for r, eng in enumerate(g.engines[:2])]
    for h in hs:
        np.testing.assert_array_equal(h.wait(10), np.full(3, 3.0))

    def refuse(ps_id, ranks):
        raise RendezvousError(f"process set {ps_id}: a member never mapped its segment")

    for eng in g.engines:
        eng.sets._make = refuse
    add = [eng.request_process_set("add", [1], Request(Kind.BARRIER, "process_set.add.[1]",
                                                       None)) for eng in g.engines]
    for r in add:
        with pytest.raises(RendezvousError, match="never mapped"):
            r.handle.wait(10)
    for eng in g.engines:
        assert eng.aborted.wait(5)


def test_cache_entry_evicted_in_the_round_that_completes_it():
    # More names in flight than the cache holds: both ranks announce "x" by its cache
    # id, but in the same round an older entry completes first and its insertion
    # evicts "x". This used to end every rank with "malformed negotiation message:
    # KeyError" (a job with more gradients than RONDE_CACHE_CAPACITY could hit it).
    from ronde.core.negotiation import Negotiator

    neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=0, cache_capacity=2)
    for name in ("x", "y"):  # the cache is full: x is the least recently used
        neg.apply_round([_announce(neg, 0, [name]), _announce(neg, 1, [name])])
    assert neg.apply_round([_announce(neg, 0, ["w"]), SILENT]) == []  # w waits for rank 1
    x0, x1 = _announce(neg, 0, ["x"]), _announce(neg, 1, ["x"])
    assert protocol.encode(x0) == protocol.encode(x1) == {"a": [0]}
    out = neg.apply_round([x0, RoundMessage(_announce(neg, 1, ["w"]).announced + x1.announced)])
    assert [(r.names, r.error) for r in out] == [(["w"], None), (["x"], None)]
    assert neg.cached_id(0, "x", ar("x", np.ones(3, np.float32)).meta()) is not None


def test_stall_stack_shows_the_users_frames_when_the_main_thread_drives():
    # a waiting caller may be the thread building the round message that carries its
    # own stack: the engine's innermost frames are left out of the report
    from ronde.core import rounds

    def users_training_step() -> str:
        return rounds.main_thread_stack()

    stack = users_training_step()
    assert "users_training_step" in stack.splitlines()[-2]
    assert "rounds.py" not in stack


def test_steady_round_gives_what_the_general_path_gives():
    # Every rank announcing the same cached ids in the same order takes a shortcut
    # (steady.py), and a round seen before replays its groups from a memo (as the
    # Announcer replays a rank's entries); all must agree with the general path on
    # every rank: names, order, fusion, fresh inline bytes and the cache's LRU order,
    # also once a tensor's metadata changed (the memos must not outlive it).
    from ronde.core import rounds
    from ronde.core.negotiation import Negotiator

    def run(fast: bool):
        neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=100, cache_capacity=8)
        steady, groups = neg.steady.replay, neg.steady._from_templates
        taken, worked_out = [], []

        def counted(*a):
            out = steady(*a) if fast else None
            taken.append(out is not None)
            return out

        def counted_groups(*a):
            worked_out.append(len(taken))
            return groups(*a)

        neg.steady.replay, neg.steady._from_templates = counted, counted_groups
        announcers = [rounds.Announcer(neg.cache, r, 16) for r in range(2)]
        names = [f"t{i}" for i in range(6)]
        seen = []
        for step in range(6):  # full metadata, cache ids (some inline), t1 changes at 3
            # 16-byte float32 ones ride inline; the larger float64 ones (another
            # reduction, so they do not absorb the small ones) fuse in the data path
            reqs = {r: [ar(n, np.full(4 + (i % 3) + (i == 1 and step >= 3),
                                      r + 1.0 + step, np.float64 if i % 3 else np.float32))
                        for i, n in enumerate(names)] for r in range(2)}
            msgs, blobs = [], []
            for r in range(2):
                if fast:
                    ann, _, blob = announcers[r](reqs[r])
                else:
                    ann, blob = rounds.announcements(
                        reqs[r], lambda n, raw, r=r: neg.cached_id(r, n, raw), 16)
                msgs.append(RoundMessage(tuple(ann)))
                blobs.append(bytes(blob))
            out = neg.apply_round(msgs, blobs)
            seen.append([(r.names, r.inline) for r in out])
        return seen, list(neg.cache._by_id), taken, worked_out

    fast, slow = run(True), run(False)
    assert fast[:2] == slow[:2]
    # the shortcut ran once the ids were cached, and again once the changed one was
    assert fast[2] == [False, True, True, False, True, True]
    # the general path at steps 0 and 3 (new metadata; it records what the next round
    # replays): the per-id templates are consulted at 1 and 4 (answering) and at 3
    # (t1 has none, so the general path runs); 2 and 5 replay whole from the round memo
    assert fast[3] == [1, 3, 4]
    inline = [next(tuple(b) for _, b in step if b) for step in fast[0][1:]]
    assert len(set(inline)) == len(inline) == 5  # inline data every step, fresh bytes
    assert any(len(names) > 1 for step in fast[0] for names, _ in step)  # and fusion


def test_small_allreduces_fuse_into_a_larger_one_of_their_message_instead_of_inline():
    # Inline data is for rounds of small tensors only: beside a larger allreduce of the
    # same reduction, a small one joins its fused data-path transfer (ResNet-50's small
    # gradients beside the large ones); a different reduction still rides inline.
    from ronde.core import rounds
    from ronde.core.negotiation import Negotiator

    neg = Negotiator(2, {0: [0, 1]}, fusion_threshold_bytes=1 << 20, cache_capacity=16)
    small = [ar(f"s{i}", np.full(4, 1.0, np.float32)) for i in range(3)]
    other = ar("i", np.full(4, 1, np.int32))
    big = ar("big", np.full(64, 1.0, np.float32))

    def cached(n, raw):
        return neg.cached_id(0, n, raw)

    # make every name known to the cache (inline data rides only with cached ids)
    msgs = [RoundMessage(tuple(rounds.announcements(small + [other, big], cached, 16)[0]))] * 2
    assert len(neg.apply_round(msgs, [b"", b""])) >= 1
    alone, blob = rounds.announcements(small, cached, 16)
    assert all(isinstance(a, protocol.Inline) for a in alone) and len(blob) == 48  # inline
    mixed, blob = rounds.announcements(small + [other, big], cached, 16)
    assert all(isinstance(a, protocol.ById) for a in mixed[:3])  # fused with "big" instead
    assert isinstance(mixed[3], protocol.Inline) and len(blob) == 16  # the int32 one is inline
    assert isinstance(mixed[4], protocol.ById)

    # ranks that decided differently (their messages differed) still agree on the result:
    # the tensors move through the data path, fused, with no inline data
    inline_msg, inline_blob = rounds.announcements(small, cached, 16)
    plain = tuple(protocol.ById(neg.cached_id(1, r.name, r.meta())) for r in small)
    out = neg.apply_round([RoundMessage(tuple(inline_msg)), RoundMessage(plain)],
                          [inline_blob, b""])
    assert [r.inline for r in out] == [None] and out[0].names == ["s0", "s1", "s2"]


def test_fused_groups_run_as_one_only_on_the_single_copy_path_and_with_fusion_on():
    # Dispatcher.dispatch attaches a round's later fused groups to the first; _parts runs
    # them as one operation only where the single-copy allreduce is in use, and
    # RONDE_FUSION_THRESHOLD=0 ("no fusion") must keep every allreduce on its own.
    from ronde._config import load
    from ronde.core.dispatch import Dispatcher
    from ronde.core.executor import Executor
    from ronde.core.negotiation import Response, fusion_key
    from ronde.core.outbox import Outbox
    from ronde.core.requests import Meta

    class Comm:
        name, _cma = "shm", True

        def reads_peers(self, nbytes, n):
            return self._cma

    comm = Comm()

    def dispatcher(threshold):
        ex = Executor(0, lambda: None, lambda exc: None, Doorbell())
        return ex, Dispatcher(0, load({"RONDE_FUSION_THRESHOLD": threshold}),
                              Communicators(0, {0: comm}, {0: [0, 1]}, lambda ps_id, ranks: None),
                              Outbox(0), ex)

    meta = Meta(ar("x", np.ones(1 << 16, np.float32)).meta())

    def responses():  # as the negotiator agrees them: each with its fusion key
        out = [Response(Kind.ALLREDUCE, 0, [n], [{0: meta, 1: meta}]) for n in "abc"]
        for r in out:
            r.fuse_key = fusion_key(0, meta)
        return out

    ex, d = dispatcher("64MiB")
    d.dispatch(responses(), None)
    lead = ex.queue.get_nowait()
    assert ex.queue.empty() and [r.names for r in lead.followers] == [["b"], ["c"]]
    # resolved where handed out: the executor runs from what each carries
    assert lead.comm is comm and lead.members == [0, 1] and lead.reqs == [None]
    assert all(f.comm is comm and f.reqs == [None] for f in lead.followers)
    one, = ex._parts(lead)
    assert one.names == ["a", "b", "c"] and one.reqs == [None] * 3 and one.comm is comm
    d.dispatch(responses(), None)
    lead = ex.queue.get_nowait()
    Comm._cma = False  # single copy refused by a member: one after the other
    assert [p.names for p in ex._parts(lead)] == [["a"], ["b"], ["c"]]
    Comm._cma = True
    ex, d = dispatcher("0")
    d.dispatch(responses(), None)
    got = [ex.queue.get_nowait() for _ in range(3)]
    assert [r.names for r in got] == [["a"], ["b"], ["c"]]
    assert all(r.followers is None for r in got)
    # a set this rank is not in never reaches the executor
    d.sets.apply(("add", 1, [1]))
    other = Response(Kind.ALLREDUCE, 1, ["z"], [{1: meta}])
    d.dispatch([other], None)
    assert ex.queue.empty()


def test_work_queued_when_the_engine_failed_or_stopped_fails_its_requests():
    # the dispatcher takes a response's requests out of the outbox when it hands the
    # response out, so the engine's own fan-out (the outbox) no longer reaches them: the
    # executor fails them with the engine's error instead of running, and what is still
    # queued when it stops fails with the shutdown's
    from ronde import PeerLostError, ShutdownError
    from ronde.core.executor import Executor
    from ronde.core.negotiation import Response
    from ronde.core.requests import Handle, Meta

    failure: list[BaseException] = []
    ex = Executor(0, lambda: failure[0] if failure else None, lambda exc: None, Doorbell())

    def queued(name):
        req = ar(name, np.ones(3))
        req.handle = Handle(name, None)
        resp = Response(Kind.ALLREDUCE, 0, [name], [{0: Meta(req.meta())}])
        resp.reqs, resp.members = [req], [0, 1]  # no communicator: it must not run
        return req, resp

    failure.append(PeerLostError("rank 1 is gone", rank=1))
    req, resp = queued("a")
    ex.execute(resp)
    with pytest.raises(PeerLostError, match="rank 1 is gone"):
        req.handle.wait(1)
    failure.clear()
    req, resp = queued("b")
    ex.enqueue(resp)  # the thread was never started: still queued at stop
    ex.stop(0.1, ShutdownError("shut down while pending"))
    with pytest.raises(ShutdownError, match="while pending"):
        req.handle.wait(1)


def test_the_executor_rings_the_control_threads_bell_as_it_runs_out_of_work_if_asked():
    # the executor knows the control thread only by its doorbell: a round waiting for the
    # executor to finish asks for the ring (``wanted``); otherwise finishing costs nothing
    from ronde.core.executor import Executor
    from ronde.core.negotiation import Response
    from ronde.transport import ready

    bell = Doorbell()
    ex = Executor(0, lambda: None, lambda exc: None, bell)
    ex.start()
    try:
        for wanted in (True, False, True):
            bell.wanted = wanted
            ex.enqueue(Response(Kind.JOIN, 0, ["join"], [{}]))  # needs no communicator
            end = time.monotonic() + 10
            while not (ex.idle() and not bell.wanted) and time.monotonic() < end:
                time.sleep(0.001)  # wanted is cleared by the ring, after idle() holds
            assert ex.idle()
            rung, _ = ready.wait([bell], [], 0.0)
            assert (rung == [bell]) is wanted and bell.pending is wanted
            assert not bell.wanted  # once
            bell.drain()
    finally:
        ex.stop(5.0, RuntimeError("stopped"))
        bell.close()


def test_the_first_failure_sets_the_abort_event_and_is_kept(engines):
    from ronde import PeerLostError

    g = engines(2)
    e = g.engines[0]
    assert not e.aborted.is_set() and e.failed is None
    first = PeerLostError("rank 1 is gone", rank=1)
    e.fail(first)
    e.fail(RuntimeError("later"))
    assert e.aborted.wait(1.0) and e.failed is first


def test_peers_hear_of_a_lost_rank_before_any_waiter_wakes(engines):
    # CI flake (np=5 over the tree): a rank's user thread woke on the PeerLostError,
    # exited and closed its sockets before its control thread had told the peers which
    # rank was lost, so a peer blamed this rank. The notice goes out first now.
    import threading
    import time

    from ronde import PeerLostError

    g = engines(2)
    e = g.engines[0]
    order: list[str] = []
    telling = threading.Event()
    told = e.exchange.tell_peers

    def slow_tell(exc):
        telling.set()
        time.sleep(0.3)
        order.append("told")
        told(exc)

    e.exchange.tell_peers = slow_tell
    lost = PeerLostError("rank 1 is gone", rank=1)
    failer = threading.Thread(target=e.fail, args=(lost,))
    failer.start()
    assert telling.wait(2.0)
    # a second failure (an executor that saw the abort) waits for the telling too
    e.fail(RuntimeError("the executor's view"))
    order.append("second fail returned")
    assert e.failed is lost and e.aborted.is_set()
    failer.join(5)
    assert order == ["told", "second fail returned"], order


def test_submissions_inside_batch_are_announced_in_one_round(engines):
    # grouped collectives (ronde._api.together): a control thread woken by the first
    # submission, or a peer's round, must not take the first tensors alone
    g = engines(2)
    announced: list[list[str]] = [[], []]
    for r, eng in enumerate(g.engines):
        real = eng._build_message

        def build(real=real, r=r):
            msg, blob = real()
            if msg.announced:
                announced[r].append(len(msg.announced))
            return msg, blob

        eng._build_message = build
    for step in range(5):
        hs = []
        for r, eng in enumerate(g.engines):
            with eng.batch():
                for i in range(12):
                    hs.append(eng.submit(ar(f"s{step}.{i}", np.full(5, r + 1.0))).handle)
                    time.sleep(0.001)  # slow submissions: the engine would not wait
        for h in hs:
            np.testing.assert_array_equal(h.wait(10), np.full(5, 3.0))
    assert announced == [[12] * 5, [12] * 5], announced


def test_a_waiting_caller_drives_its_own_ranks_engine(engines, monkeypatch):
    # with threads as ranks, a thread waiting on its handle drove the engine of the
    # process's one registry (the last rank started), and could sit in another rank's
    # round; each handle now drives the engine that made it
    from ronde.core.engine import Engine

    g = engines(3, spin_time_us=200_000.0)
    driven: dict[int, set[int]] = {r: set() for r in range(3)}
    real = Engine.progress
    import threading

    who = threading.local()

    def progress(self):
        driven[who.rank].add(self.rank)
        return real(self)

    monkeypatch.setattr(Engine, "progress", progress)

    def rank(r: int) -> None:
        who.rank = r
        for step in range(5):
            h = g.engines[r].submit(ar(f"s{step}", np.full(4, r + 1.0))).handle
            np.testing.assert_array_equal(h.wait(10), np.full(4, 6.0))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(driven[r] <= {r} for r in range(3)), driven
    assert any(driven[r] for r in range(3)), driven  # and callers did drive


def test_a_submission_wakes_a_control_thread_in_its_quiet_sleep(engines, monkeypatch):
    # with nothing pending and the lane carrying the steps, the control thread sleeps
    # _QUIET_S; a submission that its own thread says it will drive (waited_by, a step's
    # last bucket) must still wake it then, or nobody starts the round until the sleep
    # ends (here 60 s, the test's timeout, if nobody drove the round)
    import threading

    from ronde.core import engine as engine_mod

    monkeypatch.setattr(engine_mod, "_QUIET_S", 60.0)
    g = engines(2)
    for eng in g.engines:
        eng.lane.table["elsewhere"] = None  # type: ignore[assignment]  # the lane runs
    deadline = time.monotonic() + 10
    while not all(e._ctl_quiet for e in g.engines) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(e._ctl_quiet for e in g.engines)  # both asleep, quietly
    handles = []
    for r, eng in enumerate(g.engines):
        eng.waited_by(threading.get_ident())  # ... and this thread will not drive it
        handles.append(eng.submit(ar("last", np.full(3, r + 1.0))).handle)
    deadline = time.monotonic() + 10
    while not all(h.poll() for h in handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(h.poll() for h in handles)  # done with nobody driving: the round ran
    for h in handles:
        np.testing.assert_array_equal(h.wait(1), np.full(3, 3.0))
    for eng in g.engines:
        eng.lane.table.clear()
