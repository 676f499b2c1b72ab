"""The gradient pipeline every binding shares (``ronde.frameworks.gradients``): one
``Reduction`` decided when an optimizer is made, applied per gradient; numpy, one process,
a recording allreduce in place of the engine (the bindings' multi-rank tests run it for real).
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from ronde import ProcessSet, ReduceOp
from ronde.frameworks.compression import NUMPY_COMPRESSION, Compression
from ronde.frameworks.gradients import Reduction

TWO = ProcessSet([0, 1])  # a set with its ranks known: no running job needed for its size
SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "ronde"


class _Done:
    def __init__(self, value: np.ndarray) -> None:
        self.value = value

    def wait(self) -> np.ndarray:
        return self.value


class _Engine:
    """An allreduce of two ranks whose other rank sent ``other``; records what it got."""

    def __init__(self, other: np.ndarray) -> None:
        self.other, self.calls, self.sent = other, [], []

    def __call__(self, sent, out, name, op, pre, post, ps):  # the bindings' signature
        self.calls.append((name, int(op), pre, post, str(sent.dtype)))
        self.sent.append(sent)
        total = sent * pre + self.other.astype(sent.dtype) * pre
        if int(op) == int(ReduceOp.AVERAGE):
            total = total / 2
        return _Done((total * post).astype(sent.dtype))


class _CountingAdapter:
    """numpy's adapter, counting how often a compressor asks for a dtype."""

    def __init__(self) -> None:
        self.asked = 0

    def dtype_name(self, tensor: np.ndarray) -> str:
        self.asked += 1
        return np.dtype(tensor.dtype).name

    def cast(self, tensor: np.ndarray, dtype_name: str) -> np.ndarray:
        return tensor if tensor.dtype.name == dtype_name else tensor.astype(dtype_name)

    def all_finite(self, tensor: np.ndarray) -> bool:
        return bool(np.isfinite(tensor).all())


def test_configure_checks_every_argument_where_the_optimizer_is_made():
    red = Reduction.configure(None, 4.0, NUMPY_COMPRESSION.fp16, TWO, 3)
    assert (red.op, red.prescale, red.postscale, red.passes_per_step) == \
        (int(ReduceOp.AVERAGE), 0.25, 4.0, 3)
    with pytest.raises(ValueError, match="gradient_predivide_factor is only supported with "
                                         "op=Average"):
        Reduction.configure(ReduceOp.SUM, 2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        Reduction.configure(None, backward_passes_per_step=0)

    class Custom:  # a Horovod-style compressor: fine on framework tensors, not on the host
        @staticmethod
        def compress(t):
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t

    assert Reduction.configure(None, compression=Custom).compression is Custom
    with pytest.raises(TypeError, match="compression=.* is not supported here"):
        Reduction.configure(None, compression=Custom, on_host=True)


def test_an_fp16_average_is_a_sum_of_predivided_inputs_and_comes_back_in_its_dtype():
    engine = _Engine(np.full(3, 3.0, np.float32))
    red = Reduction(int(ReduceOp.AVERAGE), 1.0, 1.0, NUMPY_COMPRESSION.fp16, TWO)
    grad = np.full(3, 1.0, np.float32)
    started = red.start(grad, "g", engine)
    assert engine.calls == [("g", int(ReduceOp.SUM), 0.5, 1.0, "float16")]
    out = red.result(started)
    assert out.dtype == np.float32 and np.allclose(out, 2.0)
    # uncompressed: the op as asked, the gradient itself sent, nothing decompressed
    engine = _Engine(np.full(3, 3.0, np.float32))
    red = Reduction(int(ReduceOp.AVERAGE), 0.5, 2.0, NUMPY_COMPRESSION.none, TWO)
    started = red.start(grad, "g", engine)
    assert engine.calls == [("g", int(ReduceOp.AVERAGE), 0.5, 2.0, "float32")]
    assert engine.sent[0] is grad and np.allclose(red.result(started), 2.0)
    # integers are never cast
    engine = _Engine(np.full(2, 4, np.int64))
    red = Reduction(int(ReduceOp.SUM), compression=NUMPY_COMPRESSION.fp16, process_set=TWO)
    assert np.array_equal(red.result(red.start(np.ones(2, np.int64), "i", engine)), [5, 5])
    assert engine.calls[0][1:] == (int(ReduceOp.SUM), 1.0, 1.0, "int64")


def test_a_user_compressor_whose_context_is_none_is_still_decompressed():
    # Horovod's interface lets compress() return (tensor, None); decompress must run (the
    # steady step's shortcut for the no-op compressor once skipped it: 8x gradients)
    class Scale:
        @staticmethod
        def compress(t):
            return t * 8, None

        @staticmethod
        def decompress(t, ctx):
            return t / 8

    engine = _Engine(np.full(2, 8.0, np.float32))  # the other rank's 1, compressed
    red = Reduction(int(ReduceOp.SUM), compression=Scale, process_set=TWO)
    out = red.result(red.start(np.ones(2, np.float32), "g", engine))
    assert np.allclose(engine.sent[0], 8.0) and np.allclose(out, 2.0)
    assert np.allclose(red.decompress(np.float32(16.0), None, "x"), 2.0)


def test_a_binding_that_casts_itself_gets_the_same_wire_op():
    # JAX's sharded optimizer casts inside a trace and asks for the op (it reduced an fp16
    # Average as a float16 sum before: torch's and Keras' sharded optimizers too)
    red = Reduction(int(ReduceOp.AVERAGE), 1.0, 3.0, process_set=ProcessSet([0, 1, 2, 3]))
    assert red.wire_op("float16") == (int(ReduceOp.SUM), 0.25, 3.0)
    assert red.wire_op("bfloat16") == (int(ReduceOp.AVERAGE), 1.0, 3.0)
    assert red.wire_op(None) == (int(ReduceOp.AVERAGE), 1.0, 3.0)


def test_one_gradient_asks_its_dtype_once():
    # the compressor decides whether it casts; the wire op follows from what it returned
    # (asked twice per gradient before: the "dtype_name and compresses run twice")
    adapter = _CountingAdapter()
    red = Reduction(int(ReduceOp.AVERAGE), compression=Compression(adapter).fp16,
                    process_set=TWO)
    red.result(red.start(np.ones(4, np.float32), "g", _Engine(np.ones(4, np.float32))))
    assert adapter.asked == 1


def test_a_synchronous_collective_takes_the_same_rules():
    # torch's differentiable allreduce and Keras' sharded reduce-scatter: compress, the
    # fp16 rewrite, the collective, decompress, in one call
    seen = []

    def collective(sent, op, pre, post):
        seen.append((str(sent.dtype), int(op), pre, post))
        return ((sent * pre + np.float16(3.0) * pre) * post).astype(sent.dtype)

    red = Reduction(int(ReduceOp.AVERAGE), 1.0, 1.0, NUMPY_COMPRESSION.fp16, TWO)
    out = red.apply(np.ones(3, np.float32), "g", collective)
    assert seen == [("float16", int(ReduceOp.SUM), 0.5, 1.0)]
    assert out.dtype == np.float32 and np.allclose(out, 2.0)


def test_a_sparse_gradient_is_scaled_as_horovod_does():
    assert Reduction(int(ReduceOp.AVERAGE), 0.5, 4.0, process_set=TWO).sparse_scale() == 1.0
    assert Reduction(int(ReduceOp.SUM), 1.0, 3.0, process_set=TWO).sparse_scale() == 3.0
    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        Reduction(int(ReduceOp.MAX), process_set=TWO).sparse_scale()


def test_on_the_host_any_bindings_compressor_is_numpys_of_the_same_wire_dtype():
    other = Compression(_CountingAdapter())  # another binding's Compression
    assert Reduction(0, compression=other.bf16).on_host().compression is NUMPY_COMPRESSION.bf16
    assert Reduction(0).on_host().compression is NUMPY_COMPRESSION.none
    same = Reduction(0, compression=NUMPY_COMPRESSION.fp16)
    assert same.on_host() is same


def test_the_reduction_rules_are_written_once():
    # the fp16 rewrite and the predivide rule are applied by the pipeline only; a binding
    # that applied them itself would be a second pipeline (issue #34, item 2)
    users = {}
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for rule in ("wire_reduction(", "predivide_scales("):
            if re.search(r"(?<!def )" + re.escape(rule), text):
                users.setdefault(rule, set()).add(str(path.relative_to(SRC)))
    assert users == {"wire_reduction(": {"frameworks/gradients.py"},
                     "predivide_scales(": {"frameworks/gradients.py"}}, users
