"""The framework-neutral helpers, in process (no ranks)."""

from __future__ import annotations

import pytest

from ronde.frameworks import accumulation, compression, naming, state


def test_pass_counter_windows_and_overflow():
    c = accumulation.PassCounter(2)
    assert not c.record("w") and c.record("w")
    with pytest.raises(accumulation.TooManyPassesError, match="backward_passes_per_step=2"):
        c.record("w")
    c.reset()
    assert c.passes("w") == 0
    with pytest.raises(ValueError, match=">= 1"):
        accumulation.PassCounter(0)


def test_names_and_differences():
    with pytest.raises(ValueError, match="duplicates: 'a'"):
        naming.check_unique(["a", "b", "a"])
    t0 = naming.as_table([("w", "float32", (2, 3)), ("b", "float32", (3,))])
    t1 = naming.as_table([("w", "float32", (2, 4)), ("b", "float32", (3,)), ("x", "float32", (1,))])
    diff = naming.parameter_differences([t0, t1])
    assert "'w' is float32[2, 3] on rank 0; float32[2, 4] on rank 1" in diff
    assert "'x' exists on rank 1 but not on rank 0" in diff
    assert naming.parameter_differences([t0, dict(t0)]) is None
    assert naming.presence_name("fc.weight") == "allreduce.fc.weight.presence"


def test_wire_reduction_predivides_float16_averages():
    from ronde import Average, Sum

    assert compression.wire_reduction(Average, 1.0, 1.0, 4, "float16") == (int(Sum), 0.25, 1.0)
    assert compression.wire_reduction(Average, 1.0, 1.0, 4, "bfloat16") == (int(Average), 1.0, 1.0)
    assert compression.wire_reduction(Sum, 2.0, 1.0, 4, "float16") == (int(Sum), 2.0, 1.0)


def test_state_split_and_fill_round_trip():
    tree = {"state": {0: {"buf": ("T", 3), "step": 2}}, "groups": [{"lr": 0.1, "params": [0]}]}
    skel, tensors = state.split_tensors(tree, lambda x: isinstance(x, tuple) and x[0] == "T",
                                        lambda t: ("float32", (t[1],)))
    assert tensors == [("T", 3)]
    assert skel["state"][0]["buf"] == state.TensorSlot(0, "float32", (3,))
    assert state.fill_tensors(skel, tensors) == tree


def test_fp16_overflow_is_reported(caplog):
    torch = pytest.importorskip("torch")
    from ronde.torch import Compression

    t = torch.full((2,), 1e6)
    wire, ctx = Compression.fp16.compress(t)
    assert wire.dtype == torch.float16 and ctx.input_finite
    with caplog.at_level("WARNING", logger="ronde.frameworks.compression"):
        out = Compression.fp16.decompress(wire, ctx, "grad.big")
    assert out.dtype == torch.float32 and torch.isinf(out).all()
    assert "fp16 compression of 'grad.big' overflowed" in caplog.text
    ints = torch.ones(2, dtype=torch.int64)
    assert Compression.fp16.compress(ints)[0] is ints


def test_bucket_layout_caps_and_joins_small_buckets_to_their_neighbours():
    import torch

    from ronde.torch import _buckets

    kib = 256  # float32 elements in one KiB
    sizes = [600, 300, 2000, 2000, 100]  # KiB, in ready order
    params = [torch.zeros(s * kib) for s in sizes]
    order = list(range(len(params)))
    # the first bucket at most 1 MiB, the others at most 2 MiB; the last, 100 KiB (under
    # a quarter of 1 MiB), joins the one before it, over the cap
    assert _buckets.layout(order, params, lambda i: True, 2 << 20) == [[0, 1], [2], [3, 4]]
    # a last bucket of a quarter of the first's cap or more stays on its own
    params[4] = torch.zeros(256 * kib)
    assert _buckets.layout(order, params, lambda i: True, 2 << 20) == [[0, 1], [2], [3], [4]]
    # and a small one of another dtype too
    params[4] = torch.zeros(100 * kib, dtype=torch.float64)
    assert _buckets.layout(order, params, lambda i: True, 2 << 20) == [[0, 1], [2], [3], [4]]
    # a small first bucket (what fits before a large gradient) joins the next one, and
    # so does a small one before a gradient larger than the cap
    params = [torch.zeros(s * kib) for s in (5, 2000, 70, 3000, 10, 10, 900)]
    assert _buckets.layout(list(range(7)), params, lambda i: True, 2 << 20) == \
        [[0, 1], [2, 3], [4, 5, 6]]
    # the transformer of `python -m ronde.bench train`: 1,003 KiB + 192 KiB is one bucket
    params = [torch.zeros(1003 * kib), torch.zeros(192 * kib)]
    assert _buckets.layout([0, 1], params, lambda i: True, 25 << 20) == [[0, 1]]
