"""The mesh's links, opened on first use (transport/mesh.py): the higher rank of a pair
connects, the lower accepts; one socket per pair and channel; a peer that never opens its
side, or has left, is a typed error naming it within the wait, never a hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from ronde import PeerLostError
from ronde.transport import mesh as mesh_mod
from ronde.transport import wire

pytestmark = pytest.mark.timeout(60)
SECRET = b"s" * 32


def _meshes(n: int, ctl_peers=lambda r, n: None) -> list[mesh_mod.Mesh]:
    listeners = [mesh_mod.listen("127.0.0.1") for _ in range(n)]
    peers = [{"addr": "127.0.0.1", "port": s.getsockname()[1], "host": "h"} for s in listeners]
    meshes = [mesh_mod.Mesh(r, n, 1, SECRET, listeners[r], peers, 10.0, ctl_peers(r, n))
              for r in range(n)]
    threads = [threading.Thread(target=m.connect) for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return meshes


def test_control_sockets_at_connect_and_data_links_on_first_use():
    meshes = _meshes(4, lambda r, n: list(range(1, n)) if r == 0 else [0])
    try:
        assert [sorted(m.ctl) for m in meshes] == [[1, 2, 3], [0], [0], [0]]
        assert all(not m.data for m in meshes)
        got: dict[str, socket.socket] = {}
        waiter = threading.Thread(target=lambda: got.update(low=meshes[1].link(3, "data", 10)))
        waiter.start()  # rank 1 waits for rank 3, which connects when it needs the link
        time.sleep(0.2)
        assert waiter.is_alive()
        high = meshes[3].link(1, "data", 10)
        waiter.join(10)
        high.sendall(b"x")
        assert got["low"].recv(1) == b"x"  # one connection, seen from both ends
        assert meshes[3].link(1, "data") is high and sorted(meshes[1].data) == [3]
        assert sorted(meshes[2].data) == []  # nobody else opened anything
    finally:
        for m in meshes:
            m.close()


def test_a_peer_that_never_opens_its_side_is_named_after_the_wait():
    meshes = _meshes(2)
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 1 did not open its data") as info:
            meshes[0].link(1, "data", timeout_s=0.5)
        assert info.value.rank == 1 and time.monotonic() - t0 < 5
    finally:
        for m in meshes:
            m.close()


def test_an_abort_ends_the_wait():
    meshes = _meshes(2)
    try:
        err = PeerLostError("rank 7 was lost", rank=7)
        with pytest.raises(PeerLostError, match="rank 7"):
            meshes[0].link(1, "data", 0, aborted=lambda: err)
    finally:
        for m in meshes:
            m.close()


def test_a_peer_that_left_refuses_and_is_named_at_once():
    meshes = _meshes(2)
    meshes[0].close()  # rank 0 shut down and left: its listener is gone
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 0") as info:
            meshes[1].link(0, "data", 5.0)
        assert info.value.rank == 0 and time.monotonic() - t0 < 2
    finally:
        meshes[1].close()


def test_a_hello_from_a_rank_that_should_not_connect_is_dropped():
    meshes = _meshes(3)
    try:
        # rank 2's listener hears "rank 0, data": only higher ranks connect to a rank
        port = meshes[2]._peers[2]["port"]
        sock = wire.connect("127.0.0.1", port, SECRET, 5.0)
        wire.send_frame(sock, mesh_mod.KIND_HELLO, wire.dumps({"rank": 0, "gen": 1,
                                                               "chan": "data"}))
        sock.settimeout(5.0)
        assert sock.recv(1) == b""  # closed by the acceptor
        assert 0 not in meshes[2].data
    finally:
        for m in meshes:
            m.close()


def test_an_unreachable_peer_during_the_job_is_a_lost_peer_naming_it():
    meshes = _meshes(2)
    meshes[1]._peers[0] = {"addr": "10.255.255.1", "port": 9, "host": "far"}  # no route
    try:
        t0 = time.monotonic()
        with pytest.raises(mesh_mod.LinkError, match="rank 0") as info:
            meshes[1].link(0, "data", timeout_s=0.5)
        assert info.value.rank == 0 and isinstance(info.value, PeerLostError)
        assert time.monotonic() - t0 < 8
    finally:
        for m in meshes:
            m.close()
