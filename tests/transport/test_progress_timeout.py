"""A peer that is alive but never takes part ends a collective with PeerLostError."""

from __future__ import annotations

import os
import socket
import time
import uuid

import numpy as np
import pytest

from ronde import PeerLostError
from ronde.collectives.ops import ReduceOp
from ronde.transport.segments import Names, remove_job_segments
from ronde.transport.shm import ShmCommunicator

pytestmark = pytest.mark.timeout(30)


def test_tcp_peer_that_sends_nothing():
    from ronde.transport.tcp import SocketP2P

    a, b = socket.socketpair()
    p2p = SocketP2P(0, [0, 1], {1: a}, lambda r: f"{r} (host h)", lambda: None,
                    progress_timeout_s=1.0)
    t = time.monotonic()
    with pytest.raises(PeerLostError, match="no data moved") as info:
        p2p.recv(1, memoryview(bytearray(16)))
    assert info.value.rank == 1 and time.monotonic() - t < 3
    b.close()


def test_shm_peer_that_never_arrives():
    key = f"test{uuid.uuid4().hex[:8]}"  # (job_key() keeps it as it is)
    path_of = Names(key, b"secret").of("t")
    import threading

    # the peer maps its segment (so construction succeeds) and then never takes part
    made = {}
    t = threading.Thread(target=lambda: made.setdefault(
        "peer", ShmCommunicator(1, [0, 1], path_of, 1 << 16, lambda: None, timeout_s=5)))
    t.start()
    me = ShmCommunicator(0, [0, 1], path_of, 1 << 16, lambda: None, timeout_s=5,
                         progress_timeout_s=1.0)
    t.join(5)
    peer = made["peer"]
    t = time.monotonic()
    with pytest.raises(PeerLostError, match="no progress") as info:
        me.allreduce(np.ones(4, np.float32), ReduceOp.SUM)
    assert info.value.rank == 1 and time.monotonic() - t < 3
    me.close()
    peer.close()
    remove_job_segments(key)
    assert not [f for f in os.listdir("/dev/shm") if key in f]


def test_shm_peer_that_dies_during_start_up_fails_construction_within_the_start_timeout():
    # the peer made its segment and died before mapping the others' (SIGKILL, OOM in
    # init): construction, which agrees on single copy with every member, waited for it
    # for the progress timeout (minutes, or for ever at 0) with no engine yet to notice;
    # it gives up at the start timeout, as a segment that never appears does, and
    # leaves no file behind
    from ronde import RendezvousError
    from ronde.transport.segments import create_segment
    from ronde.transport.shm.protocol import HEADER_BYTES, SMALL_BYTES

    key = f"test{uuid.uuid4().hex[:8]}"  # (job_key() keeps it as it is)
    path_of = Names(key, b"secret").of("t")
    seg = create_segment(path_of(1), HEADER_BYTES + (1 << 16) + 2 * SMALL_BYTES)
    t = time.monotonic()
    try:
        with pytest.raises(RendezvousError, match="rank 1.*failed during start-up"):
            ShmCommunicator(0, [0, 1], path_of, 1 << 16, lambda: None, timeout_s=1.0,
                            progress_timeout_s=0.0)
        assert time.monotonic() - t < 10
        assert not os.path.exists(path_of(0))
    finally:
        seg.close()
        remove_job_segments(key)
