"""Negotiation over the binomial tree (``core/tree.py``): its shape, the merge of
grouped frames, rounds among threads as ranks, and aggregates checked as untrusted."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from ronde import ProtocolError, ShutdownError, TensorMismatchError, _config
from ronde.core import coordinator, protocol, tree
from ronde.core.channels import Channels
from ronde.core.requests import Kind, Request
from ronde.collectives.ops import ReduceOp
from ronde.transport import wire

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("size", [*range(1, 18), 31, 32, 33, 64, 100])
def test_the_tree_spans_every_rank_once(size):
    seen = [0]
    for r in range(size):
        for c in tree.children(r, size):
            assert c > r and tree.parent(c) == r
            seen.append(c)
    assert sorted(seen) == list(range(size))
    # a subtree is its root and its children's subtrees, disjoint
    for r in range(size):
        below = 0
        for c in tree.children(r, size):
            m = tree.subtree_mask(c, size)
            assert not below & m
            below |= m
        assert tree.subtree_mask(r, size) == below | (1 << r)
    assert tree.subtree_mask(0, size) == (1 << size) - 1


@pytest.mark.parametrize("size", [2, 8, 64, 1000, 1024, 4096])
def test_no_rank_has_more_than_log2_n_neighbours(size):
    bound = (size - 1).bit_length()
    assert max(len(tree.children(r, size)) for r in range(size)) == bound
    assert all(len(tree.neighbours(r, size)) <= bound for r in range(size))
    depth = max(bin(r).count("1") for r in range(size))  # hops from rank 0
    assert depth <= bound


def _payload(msg: protocol.RoundMessage, blob: bytes = b"") -> bytes:
    return protocol.pack_round(msg, blob)


def test_merged_subtrees_equal_the_group_of_all_their_frames():
    steady = _payload(protocol.RoundMessage(announced=(protocol.ById(1),)))
    other = _payload(protocol.RoundMessage(announced=(protocol.Inline(3, 0, 4),)), b"abcd")
    frames = {r: (other if r in (2, 5) else steady) for r in range(8)}
    parts = [coordinator.group({r: frames[r] for r in rs}) for rs in ([0], [1], [2, 3],
                                                                       [4, 5, 6, 7])]
    assert tree.merge(parts) == coordinator.group(frames)


def _ar(name: str, arr: np.ndarray) -> Request:
    return Request(Kind.ALLREDUCE, name, arr, op=ReduceOp.SUM)


@pytest.mark.parametrize("n", [5, 8])
def test_rounds_over_the_tree_complete_on_every_rank(engines, n):
    g = engines(n, coordinator_min=3, coordinator_tree_min=3)
    assert all(e.exchange.over_tree for e in g.engines)
    names = [f"t{i}" for i in range(12)]
    handles = []
    for r, eng in enumerate(g.engines):
        order = names if r % 2 == 0 else list(reversed(names))  # any rank may start
        handles.append({m: eng.submit(_ar(m, np.full(5, r + 1.0))).handle for m in order})
    total = n * (n + 1) / 2
    for r in range(n):
        for m in names:
            np.testing.assert_array_equal(handles[r][m].wait(20), np.full(5, total))


@pytest.mark.parametrize("tree_min", [0, 3], ids=["star", "tree"])
def test_32_ranks_with_sockets_numbered_past_1024(engines, tree_min):
    # 32 engines in one process hold ~2000 socket pairs' ends: select() refused them
    # (ValueError) before every wait went through transport/ready.py
    n = 32
    # the sockets' numbers depend on what the process holds open already (a whole run
    # holds more than this file alone): take the low numbers first, so that they are
    # past 1024 whatever ran before
    null = os.open(os.devnull, os.O_RDONLY)
    held = [os.dup(null) for _ in range(1100)]
    try:
        g = engines(n, coordinator_min=3, coordinator_tree_min=tree_min)
    finally:
        for fd in held + [null]:
            os.close(fd)
    assert max(s.fileno() for e in g.engines for s in e.exchange.sockets()) > 1024
    for step in range(3):
        hs = [e.submit(_ar(f"x{step}", np.full(3, r + 1.0))).handle
              for r, e in enumerate(g.engines)]
        for h in hs:
            np.testing.assert_array_equal(h.wait(30), np.full(3, n * (n + 1) / 2))


def test_ranks_watch_their_tree_neighbours_until_a_rank_shuts_down(engines):
    g = engines(5, coordinator_min=3, coordinator_tree_min=3, shutdown_timeout_s=1.0)
    assert [e.exchange.linked() for e in g.engines] == [[1, 2, 4], [0], [0, 3], [2], [0]]
    hs = [eng.submit(_ar("x", np.ones(2))).handle for eng in g.engines]
    for h in hs:
        h.wait(20)
    assert all(e.exchange.over_tree for e in g.engines)
    leaving = threading.Thread(target=g.engines[3].shutdown)
    leaving.start()  # its announcement ends the tree on every rank, in the same round
    deadline = time.monotonic() + 20
    while any(e.exchange.over_tree for e in g.engines) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(e.exchange.over_tree for e in g.engines)
    ex = g.engines[0].exchange
    assert ex.linked() == ex.channels.connected()  # all it holds
    hs = [eng.submit(_ar("y", np.ones(2))).handle for r, eng in enumerate(g.engines)
          if r != 3]
    for h in hs:  # the others' rounds go on, star-shaped, and agree on why
        with pytest.raises(ShutdownError, match="rank\\(s\\) 3 shut down"):
            h.wait(20)
    leaving.join(20)


def test_a_mismatch_over_the_tree_fails_every_rank(engines):
    g = engines(6, coordinator_min=3, coordinator_tree_min=3)
    hs = [eng.submit(_ar("x", np.ones(4 if r != 5 else 3, np.float32))).handle
          for r, eng in enumerate(g.engines)]
    for h in hs:
        with pytest.raises(TensorMismatchError, match="rank 5"):
            h.wait(20)


def _channels(rank: int, size: int) -> tuple[Channels, dict[int, socket.socket]]:
    mine, theirs = {}, {}
    for r in tree.neighbours(rank, size):
        mine[r], theirs[r] = socket.socketpair()
    return Channels(rank, size, mine, _config.Config(), str), theirs


def _aggregate(frames: dict[int, bytes]) -> bytes:
    return coordinator.pack_bundle(coordinator.group(frames), tree.KIND_AGGREGATE)


@pytest.mark.parametrize("ranks, match", [
    ([2], "ranks \\[2\\], not its subtree's"),     # rank 3's frames missing
    ([2, 3, 4], "ranks \\[2, 3, 4\\], not its subtree's"),  # rank 4 is not below rank 2
])
def test_an_aggregate_must_hold_exactly_its_senders_subtree(ranks, match):
    ch, theirs = _channels(0, 8)  # rank 0's children: 1, 2, 4; rank 2's subtree: 2, 3
    silent = _payload(protocol.SILENT)
    theirs[2].sendall(_aggregate({r: silent for r in ranks}))
    rd = ch.readers[2]
    rd.fill()
    with pytest.raises(ProtocolError, match=match):
        tree._aggregate(ch, rd, 2)


def test_a_malformed_aggregate_names_its_sender():
    ch, theirs = _channels(0, 8)
    theirs[4].sendall(wire.encode_frame(tree.KIND_AGGREGATE, b"\x01\x00"))
    rd = ch.readers[4]
    rd.fill()
    with pytest.raises(ProtocolError, match="rank 4 sent a malformed bundle"):
        tree._aggregate(ch, rd, 4)


def test_a_bundle_that_leaves_ranks_out_is_refused():
    ch, theirs = _channels(3, 8)  # rank 3: parent 2, no children
    theirs[2].sendall(coordinator.GO + coordinator.pack_bundle(
        coordinator.group({0: _payload(protocol.SILENT)})))
    msgs = [protocol.SILENT] * 8
    with pytest.raises(ProtocolError, match="left ranks"):
        # rank 3 sends its aggregate, drops the go, then reads a bundle of rank 0 only
        tree.run(ch, _payload(protocol.SILENT), msgs, [b""] * 8, lambda: None)
