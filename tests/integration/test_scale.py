"""Correctness beyond a few ranks (more ranks than this machine's cores): every
collective at N = 5 and 8 with negotiation through the coordinator
(``core/coordinator.py``) and at N = 7 over its tree (``core/tree.py``, forced on
from 3 ranks), the loss of a rank, the coordinator or a relay among them, named on
every survivor, ranks that go on after others left, and connections opened only as
they are needed."""

from __future__ import annotations

import pytest

from ronde.testing import run_ranks

from . import workers
from .test_failures import ronderun


#: negotiation over the binomial tree (core/tree.py) from 3 ranks on, not only from 64
TREE = {"RONDE_SHM_CONTROL": "0", "RONDE_COORDINATOR_TREE": "3"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("np_, mode", [(5, "star"), (8, "star"), (7, "tree")])
def test_every_collective_through_the_coordinator(np_, mode):
    env = TREE if mode == "tree" else {"RONDE_SHM_CONTROL": "0"}
    got = run_ranks(np_, workers.at_scale, timeout_s=200, env=env)
    assert got == [(mode, "ok")] * np_


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lost, tree", [(0, False), (3, False), (0, True), (2, True)],
                         ids=["coordinator", "member", "tree-root", "tree-relay"])
def test_a_lost_rank_is_named_on_every_survivor_at_np5(tmp_path, lost, tree):
    # over the tree (children: 0 -> 1, 2, 4; 2 -> 3) rank 2 relays rank 3's frames
    proc, elapsed = ronderun(tmp_path, 5, f"""
        import os, signal, sys, time
        import numpy as np
        import ronde as hvd
        hvd.init()
        ex = hvd._api.runtime().engine.exchange
        assert ex.coordinated and ex.over_tree == {tree}
        try:
            for i in range(100000):
                if hvd.rank() == {lost} and i == 30:
                    os.kill(os.getpid(), signal.SIGKILL)
                hvd.allreduce(np.ones(16, np.float32), name=f"step{{i % 3}}")
        except hvd.PeerLostError as exc:
            print(f"PEERLOST rank={{exc.rank}}: {{exc}}", flush=True)
            sys.exit(5)
    """, env=TREE if tree else {"RONDE_SHM_CONTROL": "0"}, timeout=100)
    assert proc.returncode != 0
    lines = proc.stdout.splitlines()
    for r in set(range(5)) - {lost}:
        line = next(l for l in lines if l.startswith(f"[{r}]<stdout>:PEERLOST"))
        assert f"rank={lost}" in line, line
    summary = [l for l in proc.stderr.splitlines() if l.startswith("ronderun: rank")][0]
    assert f"rank {lost}" in summary and "SIGKILL" in summary, proc.stderr[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", [False, True], ids=["star", "tree"])
def test_a_silent_rank_is_named_on_every_survivor_at_np5(tmp_path, tree):
    # rank 3 stops (SIGSTOP: alive, sockets open, answering nothing). Over the tree its
    # parent, rank 2, times out first (a second per level below each waiting rank) and
    # names it; its notice reaches the rest along the tree
    proc, elapsed = ronderun(tmp_path, 5, """
        import os, signal, sys, time
        import numpy as np
        import ronde as hvd
        hvd.init()
        try:
            for i in range(100000):
                if hvd.rank() == 3 and i == 30:
                    os.kill(os.getpid(), signal.SIGSTOP)
                hvd.allreduce(np.ones(16, np.float32), name=f"step{i % 3}")
        except hvd.PeerLostError as exc:
            print(f"PEERLOST rank={exc.rank}: {exc}", flush=True)
            sys.exit(5)
    """, env={**(TREE if tree else {"RONDE_SHM_CONTROL": "0"}),
              "RONDE_STALL_SHUTDOWN_TIME": "3", "RONDE_PEER_TIMEOUT": "1"}, timeout=100)
    assert proc.returncode != 0
    lines = proc.stdout.splitlines()
    for r in (0, 1, 2, 4):
        line = next((l for l in lines if l.startswith(f"[{r}]<stdout>:PEERLOST")), None)
        assert line is not None and "rank=3" in line, (r, proc.stdout[-3000:])
    # before the error, the rank waiting for it (the coordinator; over the tree, its
    # parent) warned that it had not answered (issue #32: only all-to-all rounds did)
    waiter = 2 if tree else 0
    assert f"[{waiter}]<stderr>:rank {waiter}: rank(s) [3] have not answered a negotiation " \
        "round for" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", [False, True], ids=["star", "tree"])
def test_ranks_go_on_after_the_coordinator_shut_down_and_left(tmp_path, tree):
    # ranks 0 and 1 shut down (and leave after RONDE_SHUTDOWN_TIMEOUT) while 2 and 3 go
    # on with a process set of their own: rank 2 coordinates their rounds then (over
    # the tree, rank 2 is rank 3's parent: from the shutdown on, rounds go star-shaped)
    proc, _ = ronderun(tmp_path, 4, f"""
        import time
        import numpy as np
        import ronde as hvd
        hvd.init()
        ex = hvd._api.runtime().engine.exchange
        assert ex.coordinated and ex.over_tree == {tree}
        pair = hvd.add_process_set([2, 3])
        if hvd.rank() >= 2:
            t0 = time.monotonic()
            for n in range(60):  # 3 s: well past ranks 0 and 1 leaving
                got = hvd.allreduce(np.array([1.0]), op=hvd.Sum, name="pair",
                                    process_set=pair)
                assert got[0] == 2.0
                time.sleep(0.05)
            print(f"PAIR {{time.monotonic() - t0:.1f}}", flush=True)
        hvd.shutdown()
        print("DONE", flush=True)
    """, env={**(TREE if tree else {"RONDE_SHM_CONTROL": "0"}),
              "RONDE_SHUTDOWN_TIMEOUT": "1"}, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("<stdout>:DONE") == 4
    pairs = [float(l.split("PAIR ")[1]) for l in proc.stdout.splitlines() if "PAIR" in l]
    assert len(pairs) == 2 and min(pairs) > 1.5, proc.stdout  # they outlived ranks 0, 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tree", [False, True], ids=["star", "tree"])
def test_sockets_open_only_as_the_job_needs_them_at_np5(tree):
    # under the coordinator a rank holds a control socket to rank 0 only (N - 1 in all,
    # not N(N - 1) / 2), and a data socket to a peer once bytes first move between them;
    # over the tree one to its parent and one to each child instead (rank 0: log2 N)
    got = run_ranks(5, workers.connections_on_demand, timeout_s=100,
                    env={**(TREE if tree else {"RONDE_SHM_CONTROL": "0"}),
                         "RONDE_TRANSPORT": "tcp"})
    n = 5
    assert [ctl for ctl, _, _ in got] == ([3, 1, 2, 1, 1] if tree else [n - 1] + [1] * (n - 1))
    for r, (_, ring, every) in enumerate(got):
        assert ring == sorted({(r - 1) % n, (r + 1) % n}), (r, ring)
        assert every == [p for p in range(n) if p != r], (r, every)
