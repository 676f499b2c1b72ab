"""Authentication and framing: a peer without the secret gets nothing accepted."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest

from ronde import AuthenticationError, ProtocolError, RendezvousError
from ronde.runner.rendezvous import RendezvousServer, register
from ronde.transport import wire

pytestmark = pytest.mark.timeout(30)


def test_frames_roundtrip_and_bounds():
    a, b = socket.socketpair()
    wire.send_frame(a, 3, b'{"x":1}')
    assert wire.recv_frame(b, time.monotonic() + 2) == (3, b'{"x":1}')
    a.sendall(struct.pack("!2sBI", b"rd", 3, wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="exceeds limit"):
        wire.recv_frame(b, time.monotonic() + 2)
    a.sendall(b"GET / HTTP/1.1\r\n")
    with pytest.raises(ProtocolError, match="bad frame magic"):
        wire.recv_frame(b, time.monotonic() + 2)


def test_mutual_authentication():
    a, b = socket.socketpair()
    errors = []

    def server(secret):
        try:
            wire.authenticate_server(b, secret, time.monotonic() + 2)
        except (AuthenticationError, ConnectionError) as exc:
            errors.append(exc)

    t = threading.Thread(target=server, args=(b"s3cret",))
    t.start()
    wire.authenticate_client(a, b"s3cret", time.monotonic() + 2)
    t.join()
    assert not errors
    errors.clear()
    a, b = socket.socketpair()
    t = threading.Thread(target=server, args=(b"other",))
    t.start()
    with pytest.raises(AuthenticationError, match="does not hold this job's secret"):
        wire.authenticate_client(a, b"s3cret", time.monotonic() + 2)
    a.close()
    t.join()


def test_rendezvous_survives_garbage_and_unauthenticated_peers():
    secret = os.urandom(32)
    srv = RendezvousServer(2, secret).start()
    try:
        for junk in (b"", b"\x00" * 100, os.urandom(4096), b"rd" + os.urandom(16)):
            s = socket.create_connection(srv.address)
            s.sendall(junk)
            s.close()
        with pytest.raises(AuthenticationError):
            register(srv.address, b"wrong", {"rank": 0, "size": 2, "generation": 1}, 5)
        results = {}

        def reg(r):
            results[r] = register(srv.address, secret,
                                  {"rank": r, "size": 2, "generation": 1, "host": "h"}, 10)

        threads = [threading.Thread(target=reg, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [p["rank"] for p in results[0]] == [0, 1] == [p["rank"] for p in results[1]]
    finally:
        srv.close()


def test_start_up_errors_say_what_is_wrong():
    from ronde import RendezvousError

    info = {"rank": 1, "size": 2, "generation": 1, "host": "h"}
    with pytest.raises(RendezvousError, match="cannot resolve rendezvous host"):
        register(("no-such-host.invalid", 1234), b"s", info, 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    t = time.monotonic()
    with pytest.raises(RendezvousError, match=r"cannot reach the rendezvous service .*refused"):
        register(("127.0.0.1", port), b"s", info, 1.5)
    assert time.monotonic() - t < 5


def test_a_client_without_the_secret_learns_nothing_computed_from_it():
    """The client proves the secret first: a prober gets a random nonce and a refusal,
    no MAC it could test guesses of a weak secret against offline."""
    secret = os.urandom(32)
    srv = RendezvousServer(2, secret).start()
    try:
        s = socket.create_connection(srv.address)
        s.sendall(wire.MAGIC + os.urandom(wire.NONCE_BYTES))
        nonce = wire.recv_exact(s, wire.NONCE_BYTES, time.monotonic() + 5)
        s.sendall(os.urandom(32))  # a wrong proof
        rest = b""
        s.settimeout(5)
        while chunk := s.recv(100):
            rest += chunk
        s.close()
        assert len(nonce) == wire.NONCE_BYTES and rest == b"no"
    finally:
        srv.close()


def _register_all(address, keys_and_infos):
    from ronde.runner.rendezvous import register_open

    results, threads = {}, []

    def one(i, key, info):
        try:
            results[i] = (register_open(address, info, 10) if key is None
                          else register(address, key, info, 10))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    for i, (key, info) in enumerate(keys_and_infos):
        threads.append(threading.Thread(target=one, args=(i, key, info)))
        threads[-1].start()
        time.sleep(0.3)  # registration order (orchestration only)
    for t in threads:
        t.join()
    return results


def test_the_first_registration_of_a_rank_wins_and_a_second_fails_the_start_up():
    secret = os.urandom(32)
    srv = RendezvousServer(3, secret).start()
    try:
        infos = [{"rank": r, "size": 3, "generation": 1, "host": "h"} for r in (0, 1, 1, 2)]
        got = _register_all(srv.address, [(secret, i) for i in infos])
        for i in range(4):
            assert isinstance(got[i], Exception), got
            assert "rank 1 registered twice, from 127.0.0.1:" in str(got[i])
    finally:
        srv.close()


def test_an_open_start_up_admits_the_public_key_once_and_hands_out_the_secret():
    secret = os.urandom(32)
    srv = RendezvousServer(2, secret, open_generation=1).start()
    try:
        infos = [{"rank": r, "size": 2, "generation": 1, "host": "h"} for r in range(2)]
        got = _register_all(srv.address, [(secret, infos[0]), (None, infos[1])])
        assert [p["rank"] for p in got[0]] == [0, 1]
        peers, learnt = got[1]
        assert learnt == secret and [p["rank"] for p in peers] == [0, 1]
        # formed: the public key registers nothing more, not even a new generation
        with pytest.raises(RendezvousError, match="admits a process without the job's secret "
                           "only to register one of the ranks its start-up is forming"):
            register(srv.address, wire.OPEN_KEY, dict(infos[1], generation=2), 5)
        # a late claimant of a formed generation's rank is told who holds it
        with pytest.raises(Exception, match="rank 1 registered twice"):
            register(srv.address, secret, infos[1], 5)
    finally:
        srv.close()


def test_an_open_start_up_hands_nothing_to_another_generation():
    """Registering every rank of a made-up generation 99 with the public key (issue #50)
    gets no secret and no size, and the real generation still forms."""
    from ronde.runner.rendezvous import register_open

    secret = os.urandom(32)
    srv = RendezvousServer(3, secret, open_generation=1).start()
    try:
        for r in range(3):
            with pytest.raises(RendezvousError) as info:
                register_open(srv.address, {"rank": r, "size": 3, "generation": 99,
                                            "host": "x"}, 5)
            assert "3" not in str(info.value) and secret.hex() not in str(info.value)
        for size in (2, 4):  # a wrong size is not told the right one
            with pytest.raises(RendezvousError, match="only to register one of the ranks"):
                register_open(srv.address, {"rank": 1, "size": size, "generation": 1,
                                            "host": "x"}, 5)
        with pytest.raises(RendezvousError, match="only to register one of the ranks"):
            register_open(srv.address, {"rank": 0, "size": 3, "generation": 1, "host": "x"}, 5)
        infos = [{"rank": r, "size": 3, "generation": 1, "host": "h"} for r in range(3)]
        got = _register_all(srv.address, [(secret, infos[0]), (None, infos[1]),
                                          (None, infos[2])])
        assert [p["rank"] for p in got[0]] == [0, 1, 2], got
        assert got[1][1] == got[2][1] == secret
    finally:
        srv.close()


def test_a_rank_whose_place_was_taken_is_told_by_whom_and_the_job_ends():
    """The open start-up formed with another process as rank 1 (it registered first);
    the real rank 1, late, is told that process's address (it was told "RONDE_SECRET
    differs"), and rank 0's job is ended naming it (issue #50)."""
    from ronde.runner.rendezvous import register_open

    secret = os.urandom(32)
    taken: list[tuple[str, int]] = []
    srv = RendezvousServer(2, secret, open_generation=1,
                           on_taken=lambda m, r: taken.append((m, r))).start()
    try:
        infos = [{"rank": r, "size": 2, "generation": 1, "host": "h"} for r in range(2)]
        got = _register_all(srv.address, [(secret, infos[0]), (None, infos[1])])
        assert got[1][1] == secret  # the intruder, first, got rank 1
        with pytest.raises(RendezvousError, match=r"rank 1's place in this job was taken by "
                           r"127\.0\.0\.1:\d+"):
            register_open(srv.address, infos[1], 5)
        assert len(taken) == 1 and taken[0][1] == 1
        assert taken[0][0].startswith("rank 1 was claimed by 127.0.0.1:")
    finally:
        srv.close()


def test_the_open_window_closes_after_the_start_timeout():
    srv = RendezvousServer(2, os.urandom(32), start_timeout_s=0.5, open_generation=1).start()
    try:
        time.sleep(1.0)  # past the window (orchestration: the test waits for it to close)
        from ronde.runner.rendezvous import register_open
        with pytest.raises(RendezvousError, match="no longer admits a rank without"):
            register_open(srv.address, {"rank": 1, "size": 2, "generation": 1, "host": "x"},
                          5)
    finally:
        srv.close()


def test_the_public_key_only_registers():
    from ronde.runner.rendezvous import query

    srv = RendezvousServer(2, os.urandom(32), open_generation=1).start()
    try:
        assert query(srv.address, wire.OPEN_KEY, {"what": "hosts"}) is None
        assert srv.rejections.count == 1
    finally:
        srv.close()
