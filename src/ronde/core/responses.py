"""What negotiation agrees on: :class:`Response`, one unit of work for the executor.

Every rank's :class:`~ronde.core.negotiation.Negotiator` (and its steady-state memo,
``steady.py``) computes the same list of responses in the same order; the executor
(``executor.py``) runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .requests import KIND_NAMES, Kind, Meta

if TYPE_CHECKING:
    from ..transport.base import Communicator
    from .requests import Request


def any_meta(metas: dict[int, Meta]) -> Meta:
    """One rank's metadata of a response's tensor (they agree on what matters)."""
    return metas[min(metas)]


def fusion_key(ps_id: int, meta: Meta, joined: frozenset[int] = frozenset()
               ) -> tuple[Any, ...]:
    """Allreduces with equal keys may be reduced together."""
    return (ps_id, meta.dtype, meta.op, meta.prescale, meta.postscale, joined, meta.device)


class Response:
    """One unit of work for the executor: a (possibly fused) collective, or an error."""

    __slots__ = ("kind", "ps_id", "names", "metas", "joined", "error", "error_type", "value",
                 "inline", "followers", "nbytes", "fuse_key", "reqs", "members", "comm",
                 "resident")

    def __init__(self, kind: Kind, ps_id: int, names: list[str], metas: list[dict[int, Meta]],
                 joined: frozenset[int] = frozenset(), error: str | None = None,
                 error_type: str = "mismatch", value: Any = None,
                 inline: list[bytes] | None = None) -> None:
        #: every member's (prescaled) bytes in member order, for an inline allreduce
        self.inline = inline
        self.kind = kind
        self.ps_id = ps_id
        self.names = names
        self.metas = metas
        self.joined = joined
        self.error = error
        self.error_type = error_type
        self.value = value
        #: fused groups agreed right after this one, that may run with it (executor)
        self.followers: list[Response] | None = None
        #: the bytes of its tensors together, where the negotiator worked it out (else -1)
        self.nbytes = -1
        #: allreduces with equal keys may be fused (``planner.group``); None: never
        self.fuse_key: tuple[Any, ...] | None = None
        # what running it takes, resolved where it is handed out (``dispatch.py``):
        #: this rank's request of each name (None: none here, a joined rank)
        self.reqs: list[Request | None] = []
        self.members: list[int] = []  #: the process set's members
        self.comm: Communicator | None = None  #: this rank's communicator for the set
        #: the steady lane's: where every member's vector lies in its shm segment, agreed
        #: at the meeting before it (``ShmCommunicator.allreduce_resident``), or None
        self.resident: int | None = None

    def __repr__(self) -> str:
        return f"<Response {KIND_NAMES[self.kind]} ps={self.ps_id} {self.names[:3]}{'...' if len(self.names) > 3 else ''}{' ERROR' if self.error else ''}>"
