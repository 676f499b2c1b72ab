"""How a fused allreduce runs on a communicator: the communicator's ordered strategies.

Horovod's operation-manager idea: the executor describes one agreed allreduce response
as an :class:`AllreducePlan` (its tensors, dtype, op, scale factors) and runs the first
of its communicator's :attr:`~ronde.transport.base.Communicator.allreduce_strategies`
that takes it. ``enabled(plan)`` is a pure check from what every rank knows alike;
``run(plan)`` returns the outputs, or None when the strategy turned out not to apply
(on every rank alike: the single-copy path when the ranks' first such op finds that
cross-memory reads are refused), and the next one runs. The executor never asks a
communicator what it is.

==================  ===================================================================
:class:`Resident`    shm, steady lane: a tensor that lives in every rank's segment
:class:`SingleCopy`  shm: reduce straight between the ranks' own tensors (no buffer)
:class:`Staged`      shm: pack into this rank's segment, read the result from everyone's
:class:`OneTensor`   one tensor: reduce it in its output (the input copied there first)
:class:`Fused`       pack into a private fusion buffer, reduce, unpack
==================  ===================================================================
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..collectives import fusion
from ..collectives.ops import ReduceOp

if TYPE_CHECKING:
    from .base import Communicator


@dataclasses.dataclass
class AllreducePlan:
    """One agreed allreduce response, as this rank runs it.

    ``inputs[i]`` is None where this rank has no request for tensor i (it joined: it
    contributes zeros and keeps no result); ``outputs[i]`` is the caller's ``out=``
    array or None; :meth:`output` allocates the missing ones with the request's
    allocator (``allocate(i)`` returns None where there is no request).
    """

    comm: "Communicator"
    inputs: list[np.ndarray | None]
    outputs: list[np.ndarray | None]
    sizes: list[int]
    dtype: np.dtype
    op: ReduceOp
    prescale: float
    postscale: float
    nbytes: int
    joined: bool                                   #: some rank contributes zeros
    allocate: Callable[[int], "np.ndarray | None"]  #: a new output for tensor i
    fusion_buffer: Callable[[int], np.ndarray]     #: a private byte buffer
    #: timeline phases (None: no timeline is recorded)
    mark: Callable[[str], None] | None = None
    #: shm, the steady lane: where every member's one tensor lies in its segment, agreed
    #: at the meeting before (:class:`Resident`); None elsewhere
    resident: int | None = None

    def output(self, i: int) -> np.ndarray | None:
        out = self.outputs[i]
        if out is None:
            out = self.outputs[i] = self.allocate(i)
        return out

    def all_outputs(self) -> list[np.ndarray | None]:
        return [self.output(i) for i in range(len(self.sizes))]


class Strategy:
    """One way to run an allreduce plan (see the module docstring)."""

    def enabled(self, plan: AllreducePlan) -> bool:
        return True

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        raise NotImplementedError


class Resident(Strategy):
    """shm, the steady lane: one tensor that every member holds in its own segment at the
    same place (a gradient bucket: ``ShmCommunicator.resident``), reduced where it lies,
    in place (the meeting before it was its synchronisation: an input scaled after it
    could be read half scaled, so a prescaled one takes the next strategy)."""

    def enabled(self, plan: AllreducePlan) -> bool:
        return plan.resident is not None and plan.prescale == 1.0

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        arr = plan.inputs[0]
        assert arr is not None and plan.outputs[0] is arr  # a bucket's, in place
        flat = arr.reshape(-1)
        if plan.mark is not None:
            plan.mark("TRANSFER")
        plan.comm.allreduce_resident(plan.resident, flat.size, plan.dtype, plan.op,
                                     plan.postscale)
        return [arr]


class SingleCopy(Strategy):
    """Cross-memory attach (shm): every member's tensors read in place, none staged."""

    def enabled(self, plan: AllreducePlan) -> bool:
        # not joined: every input is there (a missing request is what ``joined`` says)
        return not plan.joined and plan.comm.reads_peers(plan.nbytes, len(plan.sizes))

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        if plan.mark is not None:
            plan.mark("MEMCPY_IN")
        outs, flats = [], []
        scaled_copy, pre = fusion.scaled_copy, plan.prescale
        for i, arr in enumerate(plan.inputs):
            assert arr is not None
            out = plan.output(i)
            assert out is not None
            flat = out.reshape(-1)
            if out is not arr or pre != 1.0:
                scaled_copy(flat, arr.reshape(-1), pre)
            outs.append(out)
            flats.append(flat)
        if plan.mark is not None:
            plan.mark("TRANSFER")
        plan.comm.allreduce_scattered(flats, plan.op, plan.postscale)
        return outs


class Staged(Strategy):
    """Pack into the communicator's own staging memory (shm's segment) and unpack from the
    pieces it returns: one copy fewer than a private fusion buffer."""

    def enabled(self, plan: AllreducePlan) -> bool:
        return plan.comm.size > 1

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        comm = plan.comm
        staging = comm.staging(plan.nbytes)
        if staging is None:
            return None
        outs = plan.all_outputs()
        if plan.mark is not None:
            plan.mark("MEMCPY_IN_FUSION_BUFFER")
        fusion.pack(staging.view(plan.dtype), plan.inputs, plan.sizes, plan.prescale)
        if plan.mark is not None:
            plan.mark("TRANSFER")
        pieces = comm.allreduce_staged(plan.nbytes, plan.dtype, plan.op)
        if plan.mark is not None:
            plan.mark("MEMCPY_OUT_FUSION_BUFFER")
        try:
            fusion.unpack_pieces(pieces, outs, plan.sizes, plan.postscale)
        finally:
            comm.release()
        return outs


class OneTensor(Strategy):
    """A single tensor (not joined): reduce it where the result goes."""

    def enabled(self, plan: AllreducePlan) -> bool:
        return len(plan.inputs) == 1 and plan.inputs[0] is not None

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        arr = plan.inputs[0]
        out = plan.output(0)
        assert arr is not None and out is not None
        flat = out.reshape(-1)
        if plan.mark is not None:
            plan.mark("MEMCPY_IN")
        if out is not arr or plan.prescale != 1.0:
            fusion.scaled_copy(flat, arr.reshape(-1), plan.prescale)
        if plan.mark is not None:
            plan.mark("TRANSFER")
        plan.comm.allreduce(flat, plan.op)
        if plan.mark is not None:
            plan.mark("SCALE")
        fusion.scale_inplace(flat, plan.postscale)
        return [out]


class Fused(Strategy):
    """Anything: pack into a private fusion buffer, reduce it, unpack (always applies)."""

    def run(self, plan: AllreducePlan) -> list[np.ndarray | None] | None:
        outs = plan.all_outputs()
        flat = plan.fusion_buffer(plan.nbytes).view(plan.dtype)
        if plan.mark is not None:
            plan.mark("MEMCPY_IN_FUSION_BUFFER")
        fusion.pack(flat, plan.inputs, plan.sizes, plan.prescale)
        if plan.mark is not None:
            plan.mark("TRANSFER")
        plan.comm.allreduce(flat, plan.op)
        if plan.mark is not None:
            plan.mark("MEMCPY_OUT_FUSION_BUFFER")
        fusion.unpack(flat, outs, plan.sizes, plan.postscale)
        return outs


#: the strategies of a communicator that moves bytes itself (p2p, Gloo, MPI)
DEFAULT: Sequence[Strategy] = (OneTensor(), Fused())
#: shm: a resident tensor, single-copy reads, then the segment, then the generic ones
SHARED_MEMORY: Sequence[Strategy] = (Resident(), SingleCopy(), Staged(), OneTensor(), Fused())


def run_allreduce(plan: AllreducePlan) -> list[np.ndarray | None]:
    """Run ``plan`` with the first of its communicator's strategies that takes it."""
    for strategy in plan.comm.allreduce_strategies:
        if strategy.enabled(plan):
            outs = strategy.run(plan)
            if outs is not None:
                return outs
    raise AssertionError("no allreduce strategy took the plan (Fused always does)")
