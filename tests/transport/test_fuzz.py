"""Hostile bytes: decoders and live listeners never crash, hang or over-allocate."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import numpy as np
import pytest

from ronde import ProtocolError, RondeError
from ronde.core.rounds import FrameReader as _FrameReader
from ronde.core.protocol import SILENT, from_wire
from ronde.core.protocol import unpack_round as _unpack_round
from ronde.transport import wire
from ronde.core.negotiation import Negotiator
from ronde.core.requests import Kind, Request
from ronde.runner.rendezvous import RendezvousServer, register


def _pack_round(msg: object, blob: bytes) -> bytes:
    """A round payload with any JSON part, as a hostile peer could send it."""
    body = wire.dumps(msg)
    return struct.pack("!I", len(body)) + body + blob

pytestmark = pytest.mark.timeout(120)
N_FRAMES = 10_000


def _valid_round(rng: random.Random) -> bytes:
    metas = [Request(Kind.ALLREDUCE, f"t{i}", np.ones(rng.randint(0, 9), np.float32)).meta()
             for i in range(rng.randint(0, 3))]
    msg = {"a": [[f"n{i}", m] for i, m in enumerate(metas)] + [rng.randint(0, 2)]}
    if rng.random() < 0.3:
        msg["a"].append([0, 0, 4])
    return _pack_round(msg, os.urandom(rng.randint(0, 16)))


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.random()
        if op < 0.4 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op < 0.7 and b:
            del b[rng.randrange(len(b)):][: rng.randint(1, 10)]
        else:
            b[rng.randrange(len(b) + 1):rng.randrange(len(b) + 1)] = os.urandom(rng.randint(1, 8))
    return bytes(b)


def test_negotiation_decoder_survives_random_and_mutated_messages():
    rng = random.Random(1234)
    accepted = 0
    warm = [Request(Kind.ALLREDUCE, f"t{i}", np.ones(1, np.float32)).meta() for i in range(3)]
    for i in range(N_FRAMES):
        neg = Negotiator(2, {0: [0, 1]}, 1 << 20, 8)
        neg.apply_round([from_wire({"a": [[f"t{j}", m] for j, m in enumerate(warm)]})] * 2)  # ids 0..2
        base = _valid_round(rng)
        payload = os.urandom(rng.randint(0, 64)) if i % 3 == 0 else _mutate(base, rng)
        try:
            msg, blob = _unpack_round(payload, 1)
            neg.apply_round([SILENT, msg], [b"", blob])
            accepted += 1
        except RondeError:
            pass  # the only acceptable failure: a typed, named protocol error
    assert accepted > 300  # the mutations are not all trivially rejected


_WEIRD = [None, -1, 2**70, 1.5, "x", "", [], [1, "a"], {"k": 1}, True, "float32", [-5],
          [2**40, 2**40], "bfloat16", "object", "<U3"]


def test_negotiation_survives_well_formed_json_with_hostile_fields():
    rng = random.Random(4321)
    for _ in range(N_FRAMES):
        neg = Negotiator(2, {0: [0, 1]}, 1 << 20, 8)
        meta = Request(Kind.ALLREDUCE, "t", np.ones(3, np.float32)).meta()
        meta[rng.randrange(len(meta))] = rng.choice(_WEIRD)
        ann: object = ["t", meta]
        if rng.random() < 0.2:
            ann = rng.choice(_WEIRD)
        msg: object = {"a": [ann]}
        if rng.random() < 0.2:
            msg = {rng.choice(["a", "j", "s", "ps", "x", "k", "st"]): rng.choice(_WEIRD)}
        good = {"a": [["t", Request(Kind.ALLREDUCE, "t", np.ones(3, np.float32)).meta()]]}
        try:
            payload = _pack_round(msg, b"")  # type: ignore[arg-type]
            m, blob = _unpack_round(payload, 1)
            neg.apply_round([from_wire(good), m], [b"", blob])
        except RondeError:
            pass


def test_frame_reader_bounds_lengths_before_allocating():
    a, b = socket.socketpair()
    b.setblocking(False)
    reader = _FrameReader(b)
    a.sendall(struct.pack("!2sBI", b"rd", 3, 2**32 - 1))
    reader.fill()
    with pytest.raises(ProtocolError, match="exceeds limit"):
        reader.pop()
    rng = random.Random(7)
    for _ in range(2000):
        reader.buf = bytearray(os.urandom(rng.randint(0, 40)))
        try:
            while reader.pop() is not None:
                pass
        except ProtocolError:
            pass
    assert len(reader.buf) < 1024


def test_live_rendezvous_ignores_garbage_while_a_job_registers():
    secret = os.urandom(32)
    srv = RendezvousServer(2, secret).start()
    stop = threading.Event()
    sent = [0]

    def attacker() -> None:
        rng = random.Random(99)
        while not stop.is_set() and sent[0] < 2000:
            try:
                s = socket.create_connection(srv.address, timeout=1)
                junk = rng.choice([os.urandom(rng.randint(0, 300)), b"rd" + os.urandom(16),
                                   b"rd" + os.urandom(16) + os.urandom(32)])
                s.sendall(junk)
                s.close()
                sent[0] += 1
            except OSError:
                pass

    threads = [threading.Thread(target=attacker) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        results = {}

        def reg(r: int) -> None:
            results[r] = register(srv.address, secret,
                                  {"rank": r, "size": 2, "generation": 1, "host": "h"}, 20)

        regs = [threading.Thread(target=reg, args=(r,)) for r in range(2)]
        for t in regs:
            t.start()
        for t in regs:
            t.join(30)
        assert sorted(results) == [0, 1]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        srv.close()
    assert sent[0] > 50
    assert threading.active_count() < 50  # connection threads do not pile up
