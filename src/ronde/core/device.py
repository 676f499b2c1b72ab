"""Accelerator tensors: collectives that keep the data on the device.

Where it sits in the engine cycle: negotiation treats a device tensor like any other
(its metadata says ``device=1``, and every rank must agree on it, so a rank never runs a
host collective against a peer's device collective); the executor, when it reaches an
agreed response whose tensors are on a device, hands them to the
:class:`DeviceBackend` a framework binding registered (``ronde.torch`` registers one
that fuses on the device and reduces through a torch.distributed NCCL group). Order,
fusion grouping, validation, stall detection and the timeline stay the engine's.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .._ops import ReduceOp


class DeviceBackend(Protocol):
    """What a binding provides to run collectives on its device tensors."""

    def allreduce(self, ps_id: int, members: Sequence[int], tensors: Sequence[Any | None],
                  shapes: Sequence[tuple[int, ...]], dtype: str, op: ReduceOp,
                  prescale: float, postscale: float, outs: Sequence[Any | None]) -> list[Any]:
        """Allreduce (fused) the tensors; ``None`` entries (joined ranks) count as zeros.

        ``op`` is never AVERAGE (the engine turned it into SUM and a postscale).
        Returns one result per input (``outs[i]`` when given, for in-place calls).
        """

    def broadcast(self, ps_id: int, members: Sequence[int], tensor: Any, root: int,
                  out: Any | None) -> Any:
        """Broadcast from global rank ``root``; returns the result tensor."""


_backend: DeviceBackend | None = None


def register(backend: DeviceBackend) -> None:
    """Make ``backend`` run every device collective of this process."""
    global _backend
    _backend = backend


def backend() -> DeviceBackend | None:
    return _backend
