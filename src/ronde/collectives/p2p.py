"""The point-to-point interface every collective algorithm is written against.

A transport (TCP, shared memory, MPI, the in-process loopback used by tests)
exposes one :class:`P2P` endpoint per member of a group (a process set). The
algorithms in :mod:`ronde.collectives` only ever call ``send``/``recv``/``sendrecv``
on it, with byte memoryviews of contiguous numpy arrays, so they are transport
neutral.

Contract a transport must honour:

* ``send`` and ``recv`` move the whole buffer; ``recv`` fills exactly ``len(buf)``
  bytes and a transport should raise ``ValueError`` when the incoming message has
  another length.
* Messages between one ordered pair of ranks arrive in the order they were sent.
* ``sendrecv`` is full duplex: two ranks calling it towards each other at the same
  time must not deadlock, whatever the message sizes.
* Zero-length buffers are accepted and do nothing. The algorithms never rely on
  an empty message being delivered: both sides of a pair always skip the same
  empty pieces (see :func:`exchange`).

This module also holds the small array helpers shared by the algorithm modules.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["P2P", "byte_view", "exchange", "flat_view"]


@runtime_checkable
class P2P(Protocol):
    """Point-to-point channels among the members of one group (a process set).

    Attributes:
        rank: This member's index in the group, ``0..size-1``.
        size: Number of members in the group.
    """

    rank: int
    size: int

    def send(self, peer: int, buf: memoryview) -> None:
        """Send the whole of ``buf`` to ``peer``; blocks until the buffer may be reused."""
        ...

    def recv(self, peer: int, buf: memoryview) -> None:
        """Receive exactly ``len(buf)`` bytes from ``peer`` into ``buf``."""
        ...

    def sendrecv(
        self, send_peer: int, send_buf: memoryview, recv_peer: int, recv_buf: memoryview
    ) -> None:
        """Send ``send_buf`` to ``send_peer`` while receiving ``recv_buf`` from ``recv_peer``.

        Full duplex: must not deadlock when the peers call it towards each other.
        """
        ...


def byte_view(arr: np.ndarray) -> memoryview:
    """A writable byte memoryview of a contiguous array, without copying.

    Goes through ``view(np.uint8)`` because ``memoryview()`` refuses dtypes the
    buffer protocol cannot describe (``ml_dtypes.bfloat16``).
    """
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def flat_view(arr: np.ndarray, what: str) -> np.ndarray:
    """``arr`` as a 1-D view (never a copy) so in-place results reach the caller.

    Raises:
        ValueError: ``arr`` is not C-contiguous.
    """
    if not arr.flags.c_contiguous:
        raise ValueError(
            f"{what}: buffer of shape {arr.shape} is not C-contiguous; "
            "pass np.ascontiguousarray(buf) and copy the result back"
        )
    return arr.reshape(-1)


def exchange(
    p2p: P2P,
    send_peer: int,
    send_buf: np.ndarray,
    recv_peer: int,
    recv_buf: np.ndarray,
) -> None:
    """``sendrecv`` that leaves out an empty side (or both).

    Both ends of a pair compute the same length for the same piece, so they skip
    the same messages; this keeps algorithms correct on transports that do send
    a frame for an empty buffer as well as on those that do not.
    """
    has_send = send_buf.size > 0
    has_recv = recv_buf.size > 0
    if has_send and has_recv:
        p2p.sendrecv(send_peer, byte_view(send_buf), recv_peer, byte_view(recv_buf))
    elif has_send:
        p2p.send(send_peer, byte_view(send_buf))
    elif has_recv:
        p2p.recv(recv_peer, byte_view(recv_buf))
