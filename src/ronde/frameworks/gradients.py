"""The gradient pipeline every binding's optimizer shares: decided once, applied per tensor.

What a ``DistributedOptimizer`` (torch, TensorFlow, Keras, JAX, MXNet) or a
``DistributedGradientTape`` does with a gradient is the same everywhere, and is written
here once:

* :meth:`Reduction.configure` turns the user's arguments into one reduction:
  the op resolved (Average by default), Horovod's ``gradient_predivide_factor`` as a
  prescale and a postscale (one rule and one message: :func:`ronde._ops.predivide_scales`),
  the compressor checked (where tensors are reduced on the host, only ronde's
  ``Compression.none/fp16/bf16`` can be applied), ``backward_passes_per_step`` checked.
* :meth:`Reduction.start` and :meth:`Reduction.result` move one dense
  gradient (or one bucket's flat buffer): compress it, rewrite an fp16 Average as a Sum
  of pre-divided inputs (:func:`.compression.wire_reduction`), start the allreduce,
  and, once it is done, decompress. torch's gradient hooks call them with torch tensors
  and an in-place allreduce; :mod:`.host_reduce` calls them with numpy arrays for the
  bindings whose gradients reach the engine on the host (TensorFlow graphs, Keras 3 on
  every backend, JAX's host callbacks, MXNet).
* :meth:`Reduction.apply` is the same for a synchronous collective (torch's
  differentiable ``allreduce``, Keras' sharded reduce-scatter); :meth:`Reduction.wire`
  and :meth:`Reduction.decompress` are its two halves, for a caller that compresses
  several tensors as one group.
* :meth:`Reduction.on_host` is the same reduction with the compressor applied to numpy
  arrays (any binding's ``Compression.fp16`` becomes numpy's).
* :meth:`Reduction.sparse_scale` is the factor of a sparse gradient, which is
  allgathered (values and indices) and scaled, as Horovod does.

What stays in a binding: how its gradients are found (hooks, a tape, a host callback),
naming (:mod:`.naming`), pass counting (:mod:`.accumulation`), and the tensor adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from .._ops import ReduceOp, predivide_scales
from ..process_sets import ProcessSet, global_process_set
from .accumulation import PassCounter
from .compression import (Compresses, CompressionContext, Compressor, WireReduction,
                          host_compressor, wire_dtype_of, wire_reduction)


class Started(NamedTuple):
    """One gradient's allreduce in flight (what :meth:`Reduction.result` takes)."""

    handle: Any
    #: the compressor's context
    ctx: Any
    name: str


#: the context :meth:`Reduction.start` gives a gradient it sent uncompressed (a user's
#: compressor may return ``None`` as its own context and still want ``decompress``)
AS_SENT = CompressionContext(None, True)


@dataclass(frozen=True)
class Reduction:
    """How one optimizer's gradients are reduced over the ranks.

    Attributes:
        op: a ``ReduceOp`` value.
        prescale: factor applied before the reduction (``1/gradient_predivide_factor``).
        postscale: factor applied after it.
        compression: the binding's compressor (``Compression.none`` when not compressing).
        process_set: the ranks taking part.
        passes_per_step: backward passes accumulated locally before each reduction.
    """

    op: int
    prescale: float = 1.0
    postscale: float = 1.0
    compression: Compresses | None = None
    process_set: ProcessSet = global_process_set
    passes_per_step: int = 1

    @classmethod
    def configure(cls, op: Any, gradient_predivide_factor: float = 1.0,
                  compression: Compresses | None = None,
                  process_set: ProcessSet = global_process_set,
                  backward_passes_per_step: int = 1, *,
                  on_host: bool = False) -> Reduction:
        """The reduction a binding's optimizer or tape was asked for (checked now, so a
        wrong argument fails where the optimizer is made, not in its first step).

        Args:
            op: the user's ``op=`` (None: Average).
            gradient_predivide_factor: Horovod's predivide factor (Average only).
            compression: ``Compression.none/fp16/bf16`` or a Horovod-style compressor.
            process_set: the ranks that average their gradients.
            backward_passes_per_step: passes accumulated before each reduction (>= 1).
            on_host: the gradients are reduced as numpy arrays (:mod:`.host_reduce`),
                where only ronde's own compressors can be applied.

        Raises:
            ValueError: an unknown op, a predivide factor with an op other than Average,
                ``backward_passes_per_step`` < 1.
            TypeError: on the host, a compressor other than ronde's.
        """
        from .. import _api

        resolved = _api.resolve_op(op, None)
        pre, post = predivide_scales(resolved, gradient_predivide_factor)
        if on_host:
            wire_dtype_of(compression)  # raises for a compressor the host cannot apply
        passes = PassCounter(backward_passes_per_step).passes_per_step
        return cls(int(resolved), pre, post, compression, process_set, passes)

    def on_host(self) -> Reduction:
        """This reduction for numpy arrays: the compressor is numpy's of the same wire
        dtype (a binding's ``Compression.fp16`` casts its own tensors).

        Raises:
            TypeError: a Horovod-style compressor of the user's own, which runs on
                framework tensors and cannot be applied to numpy arrays.
        """
        host = host_compressor(wire_dtype_of(self.compression))
        return self if host is self.compression else replace(self, compression=host)

    def set_size(self) -> int:
        """Ranks of the process set (those a Sum of pre-divided inputs divides by)."""
        from .. import _api

        return _api.set_size(self.process_set)

    def wire(self, tensor: Any, sent: Any, ctx: Any) -> WireReduction:
        """The op and scale factors the engine gets for ``sent``, what the compressor
        made of ``tensor`` (with ``ctx``): an fp16 Average becomes a Sum of pre-divided
        inputs (:func:`.compression.wire_reduction`); otherwise the reduction's own."""
        if sent is not tensor and type(ctx) is CompressionContext and ctx.dtype_name:
            # cast by one of ronde's compressors (its context says so: its dtype test
            # does not run twice)
            return self.wire_op(self.compression.wire_dtype)  # type: ignore[union-attr]
        return WireReduction(self.op, self.prescale, self.postscale)

    def wire_op(self, wire_dtype: str | None) -> WireReduction:
        """The op and scale factors when this reduction's floats travel as ``wire_dtype``
        (``None``: as they are); for a binding that casts them itself (JAX, inside a
        trace)."""
        return wire_reduction(self.op, self.prescale, self.postscale, self.set_size(),
                              wire_dtype)

    def decompress(self, out: Any, ctx: Any, name: str | None) -> Any:
        """``out`` (reduced on the wire) back in the gradient's dtype (always called, as
        Horovod does: a compressor of the user's own may need its context even where it
        sent the tensor itself; ronde's return ``out`` at once then)."""
        comp = self.compression
        if comp is None or ctx is AS_SENT:  # ``start`` sent it as it is
            return out
        if isinstance(comp, Compressor):
            return comp.decompress(out, ctx, name)
        return comp.decompress(out, ctx)  # a Horovod-style compressor

    @property
    def as_sent(self) -> bool:
        """Whether :meth:`start` sends a tensor as it is: no compression (or ronde's
        ``Compression.none``, which would send it as it is, with a context saying so)."""
        comp = self.compression
        return comp is None or (type(comp) is Compressor and comp.wire_dtype is None)

    def start(self, tensor: Any, name: str, allreduce: Callable[..., Any],
              out: Any = None) -> Started:
        """Start the allreduce of one dense gradient (or a bucket's flat buffer).

        Args:
            tensor: the gradient, in the binding's tensor type.
            name: the collective's name (the same on every rank).
            allreduce: ``(tensor, output, name, op, prescale, postscale, process_set) ->
                handle``: the binding's asynchronous allreduce (in place for torch).
            out: where the result goes, if the binding's collective takes one (only
                where the tensor travels as it is: a compressed one's result is in the
                wire's dtype)
        """
        if self.as_sent:
            handle = allreduce(tensor, out, name, self.op, self.prescale, self.postscale,
                               self.process_set)
            return Started(handle, AS_SENT, name)
        sent, ctx = self.compression.compress(tensor)  # type: ignore[union-attr]
        op, pre, post = self.wire(tensor, sent, ctx)
        handle = allreduce(sent, None, name, op, pre, post, self.process_set)
        return Started(handle, ctx, name)

    def result(self, started: Started) -> Any:
        """Wait for what :meth:`start` started; the reduced gradient (decompressed, in
        the gradient's own dtype)."""
        return self.decompress(started.handle.wait(), started.ctx, started.name)

    def apply(self, tensor: Any, name: str | None,
              collective: Callable[[Any, int, float, float], Any]) -> Any:
        """:meth:`start` and :meth:`result` for a synchronous ``collective(sent, op,
        prescale, postscale) -> reduced`` (its name and process set bound by the caller)."""
        comp = self.compression
        sent, ctx = comp.compress(tensor) if comp is not None else (tensor, None)
        op, pre, post = self.wire(tensor, sent, ctx)
        return self.decompress(collective(sent, op, pre, post), ctx, name)

    def sparse_scale(self) -> float:
        """The factor an allgathered sparse gradient (every rank's values) is scaled by:
        the prescale and postscale, and ``1/size`` for an Average.

        Raises:
            ValueError: an op other than Sum and Average (a sparse gradient is gathered,
                not reduced; ``sparse_as_dense=True`` reduces it as a dense one).
        """
        scale = self.prescale * self.postscale
        if self.op == int(ReduceOp.AVERAGE):
            return scale / self.set_size()
        if self.op != int(ReduceOp.SUM):
            raise ValueError("a sparse gradient is reduced with op=Sum or Average only; "
                             "pass sparse_as_dense=True")
        return scale
