"""Horovod's documented torch behaviour, checked inside real worker processes.

Each function checks one group of facts that Horovod's own ``test/parallel/test_torch.py``
relies on, written here from Horovod's documentation and its autograd rules (not from its
test code). Every function takes its expectations from rank()/size(), so it runs at any
np >= 2, and returns "ok".
"""

from __future__ import annotations

import time

import numpy as np


def _setup():
    import torch

    import ronde.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    return torch, hvd


def scaling_arithmetic() -> str:
    """prescale/postscale as Horovod computes them: integers in float64 then truncated,
    float16 in float32 then rounded once, other floats in their own dtype; Average
    divides by the size (x / 3, not x * (1/3))."""
    torch, hvd = _setup()
    n = hvd.size()
    factor = 0.3719  # not a power of two: every rounding step shows
    base = torch.arange(-20, 21, dtype=torch.float64) * 2.75
    for dt in (torch.int32, torch.int64, torch.float16, torch.float32, torch.float64):
        x = base.to(dt)
        if dt in (torch.int32, torch.int64):
            wide, f = x.double(), torch.tensor(factor, dtype=torch.float64)
        elif dt == torch.float16:
            wide, f = x.float(), torch.tensor(factor, dtype=torch.float32)
        else:
            wide, f = x, torch.tensor(factor, dtype=torch.float64).to(dt)
        pre = hvd.allreduce(x, op=hvd.Sum, prescale_factor=factor, name=f"pre.{dt}")
        one = (f * wide).to(dt)
        expect = one
        for _ in range(n - 1):  # the sum of n equal contributions, in the tensor's dtype
            expect = expect + one
        assert torch.equal(pre, expect), (dt, pre, expect)
        post = hvd.allreduce(x, op=hvd.Sum, postscale_factor=factor, name=f"post.{dt}")
        summed = x
        for _ in range(n - 1):
            summed = summed + x
        expect = (f * (summed.double() if dt in (torch.int32, torch.int64) else
                       summed.float() if dt == torch.float16 else summed)).to(dt)
        assert torch.equal(post, expect), (dt, post, expect)
    # Average of a float divides by the size exactly
    x = torch.tensor([75.0, 71.0, -94.0, 65.0, 16.0]) * (hvd.rank() + 1)
    total = sum(torch.tensor([75.0, 71.0, -94.0, 65.0, 16.0]) * (q + 1) for q in range(n))
    assert torch.equal(hvd.allreduce(x, name="avg.exact"), total / n)
    # reducescatter takes the same factors
    rs = hvd.reducescatter(torch.ones(n * 2, dtype=torch.int32) * 7, op=hvd.Sum,
                           prescale_factor=0.5, name="rs.pre")
    assert torch.equal(rs, torch.full((2,), 3 * n, dtype=torch.int32)), rs
    return "ok"


def join_average() -> str:
    """After a rank joined, Average still divides by the whole set (the joined rank adds
    zeros): Horovod's result is tensor * (size - 1) / size."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    t = torch.tensor([75.0, 71.0, -94.0, 65.0, 16.0])
    ti = torch.tensor([75, 71, -94, 65, 17], dtype=torch.int64)
    if r == 0:
        last = hvd.join()
    else:
        a = hvd.allreduce(t, name="join.a")
        b = hvd.allreduce(ti, name="join.b")
        assert torch.equal(a, t * (n - 1) / n), a
        assert torch.equal(b, (ti * (n - 1)).div(n, rounding_mode="trunc")), b
        last = hvd.join()
    assert last != 0  # rank 0 joined first
    assert hvd.allgather_object(last) == [last] * n
    return "ok"


def grouped_allgather_and_reducescatter() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    rows = [r + 1, 2]
    parts = [torch.full((k, 3), float(r)) for k in rows]
    outs = hvd.grouped_allgather(parts)
    assert [tuple(o.shape) for o in outs] == [(n * (n + 1) // 2, 3), (2 * n, 3)]
    assert torch.equal(outs[1][2 * (n - 1):], torch.full((2, 3), float(n - 1)))
    h = hvd.grouped_allgather_async(parts, name="gag")
    assert [torch.equal(a, b) for a, b in zip(hvd.synchronize(h), outs)] == [True, True]
    xs = [torch.arange(n * 2, dtype=torch.float32) + r, torch.ones(n, 2) * (r + 1)]
    got = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    tri = n * (n + 1) // 2
    assert torch.equal(got[0], (torch.arange(n * 2, dtype=torch.float32) * n
                                + n * (n - 1) // 2)[2 * r: 2 * r + 2])
    assert torch.equal(got[1], torch.full((1, 2), float(tri)))
    h = hvd.grouped_reducescatter_async(xs, op=hvd.Average, name="grs")
    assert torch.equal(hvd.synchronize(h)[1], torch.full((1, 2), tri / n))
    # on process sets: the evens and the odds, each in its own groups
    evens = hvd.add_process_set(list(range(0, n, 2)))
    odds = hvd.add_process_set(list(range(1, n, 2)))
    mine = evens if r % 2 == 0 else odds
    got = hvd.grouped_allgather([torch.tensor([float(r)])], process_set=mine)
    assert got[0].tolist() == [float(q) for q in mine.ranks]
    got = hvd.grouped_reducescatter([torch.ones(mine.size()) * r], op=hvd.Sum, process_set=mine)
    assert got[0].tolist() == [float(sum(mine.ranks))]
    hvd.remove_process_set(odds)
    hvd.remove_process_set(evens)
    return "ok"


def gradients() -> str:
    """Horovod's autograd rules: allgather and broadcast average the incoming gradient;
    reducescatter multiplies it by the size for Sum (not for Average) and by the scales."""
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    sizes = [3, 2, 7, 4, 6][:n]
    # the same upstream gradient on every rank: slice k holds k
    up = torch.cat([torch.full((k, 4), float(q)) for q, k in enumerate(sizes)])
    x = torch.ones(sizes[r], 4, requires_grad=True)
    hvd.allgather(x).backward(up)
    assert torch.equal(x.grad, torch.full((sizes[r], 4), float(r))), x.grad
    xs = [torch.ones(sizes[r], 4, requires_grad=True) for _ in range(2)]
    for g in hvd.grouped_allgather(xs):
        g.backward(up)  # one output at a time, as Horovod's test does
    for t in xs:
        assert torch.equal(t.grad, torch.full((sizes[r], 4), float(r))), t.grad
    # broadcast: the average of the ranks' gradients at the root, zeros elsewhere
    b = torch.ones(5, requires_grad=True)
    (hvd.broadcast(b, root_rank=n - 1) * (r + 1)).sum().backward()
    want = (n + 1) / 2 if r == n - 1 else 0.0
    assert torch.equal(b.grad, torch.full((5,), want)), b.grad
    # reducescatter: Sum -> size * g; Average -> g; times the scale factors
    for op, scale in ((hvd.Sum, n), (hvd.Average, 1)):
        y = torch.ones(n * 2, 3, requires_grad=True)
        hvd.reducescatter(y, op=op).backward(torch.ones(2, 3))
        assert torch.equal(y.grad, torch.full((n * 2, 3), float(scale))), (op, y.grad)
    ys = [torch.ones(n * 2, requires_grad=True) for _ in range(2)]
    for s in hvd.grouped_reducescatter(ys, op=hvd.Sum, prescale_factor=0.5):
        s.backward(torch.ones(2))
    for y in ys:
        assert torch.equal(y.grad, torch.full((n * 2,), n * 0.5)), y.grad
    return "ok"


def errors_and_handles() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    # a collective's failure is a HorovodInternalError (and a RuntimeError)
    try:
        hvd.allreduce(torch.ones(r + 1), name="bad.shape")
        raise AssertionError("no error for mismatched shapes")
    except hvd.HorovodInternalError as exc:
        assert isinstance(exc, RuntimeError) and "shape" in str(exc), exc
    for bad in (lambda: hvd.reducescatter(torch.ones(4 * n), op=hvd.Adasum),
                lambda: hvd.reducescatter(torch.tensor(float(r)), op=hvd.Average)):
        try:
            bad()
            raise AssertionError("no error")
        except RuntimeError:
            pass
    # sparse_allreduce_async's handle is callable, as Horovod's is
    dense = torch.zeros(6, 2)
    dense[r % 6] = r + 1.0
    h = hvd.sparse_allreduce_async(dense.to_sparse(), op=hvd.Average, name="sparse.h")
    got = h()
    assert torch.allclose(got.to_dense(), hvd.allreduce(dense, name="sparse.ref")), got
    assert hvd.HorovodInternalError is hvd.CollectiveError
    return "ok"


def optimizer_attributes_and_process_sets() -> str:
    torch, hvd = _setup()
    r, n = hvd.rank(), hvd.size()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    names = dict(model.named_parameters())
    assert {p: n_ for n_, p in names.items()} == opt._parameter_names
    try:  # a process set nobody registered: refused, not silently left unreduced
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 process_set=hvd.ProcessSet([0]))
        raise AssertionError("no error")
    except hvd.ProcessSetError:
        pass
    # a DistributedOptimizer on the evens: odd ranks step on their own gradients
    evens = hvd.add_process_set(list(range(0, n, 2)))
    torch.manual_seed(r)
    model = torch.nn.Linear(5, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), process_set=evens)
    opt.zero_grad()
    model(torch.randn(8, 5)).pow(2).sum().backward()
    opt.step()
    w = hvd.allgather(model.weight.detach().reshape(1, -1))
    for q in range(n):
        same = torch.equal(w[q], w[0])
        assert same == (q % 2 == 0), (q, same)
    hvd.remove_process_set(evens)
    return "ok"


def optimizer_state_and_sparse() -> str:
    torch, hvd = _setup()
    r = hvd.rank()

    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3]).int(), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4))

    model = Frozen()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # Horovod creates the state by a step on zero gradients: trainable parameters have one
    assert model.a.grad is None
    assert torch.equal(model.b.grad, torch.zeros(4))
    assert "momentum_buffer" in opt.state[model.b]
    # SparseAdam on a sparse embedding, sparse gradients allgathered or densified
    for as_dense in (False, True):
        emb = torch.nn.Embedding(10, 3, sparse=True)
        hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense)
        idx = torch.tensor([[1, 2, 4], [4, 3, 9]]) if r == 0 else torch.tensor([[1, 7]])
        opt.zero_grad()
        emb(idx).sum().backward()
        opt.step()
        w = hvd.allgather(emb.weight.detach().unsqueeze(0))
        assert all(torch.allclose(w[0], w[q]) for q in range(len(w))), as_dense
    return "ok"


def crossed_collectives() -> str:
    """A rank that moved on to a barrier while another waits in an allreduce: the
    allreduce fails on every rank with DeadlockError, the barrier stays, and the job goes
    on in step (a test suite's tearDown barrier is where the ranks meet again)."""
    import ronde as hvd

    hvd.init()
    r = hvd.rank()
    if r == 0:
        try:
            hvd.allreduce(np.ones(3), name="left.behind")
            raise AssertionError("no DeadlockError")
        except hvd.DeadlockError as exc:
            msg = str(exc)
            assert "'left.behind'" in msg and "did not submit it" in msg, msg
            assert "waits in barrier" in msg and "RONDE_DEADLOCK_TIME" in msg, msg
            assert isinstance(exc, hvd.HorovodInternalError)
    hvd.barrier()  # rank 0 arrives late: every rank passes it together
    # process-set requests that cross each other fail the same way
    if r == 0:
        try:
            hvd.add_process_set([0])
            raise AssertionError("no DeadlockError")
        except hvd.DeadlockError as exc:
            assert "add_process_set" in str(exc), exc
        hvd.barrier()
    else:
        try:
            hvd.allgather(np.ones(1), name="other.path")
            raise AssertionError("no DeadlockError")
        except hvd.DeadlockError:
            pass
        hvd.barrier()
    assert float(hvd.allreduce(np.ones(1), op=hvd.Sum, name="in.step")[0]) == hvd.size()
    hvd.shutdown()
    return "ok"


def busy_rank_is_not_a_deadlock() -> str:
    """A rank whose main thread waits while another of its threads computes (its CPU
    busy) is not waiting: that thread may still submit what the others wait for."""
    import threading

    import ronde as hvd

    hvd.init()
    r = hvd.rank()
    if r == 0:
        def late() -> None:
            end = time.monotonic() + 3.0  # three times RONDE_DEADLOCK_TIME of work
            x = 0
            while time.monotonic() < end:
                x += 1
            hvd.allreduce(np.ones(2), name="from.thread")

        t = threading.Thread(target=late)
        t.start()
        hvd.allreduce(np.ones(2), name="from.main")
        t.join()
    else:
        hvd.allreduce(np.ones(2), name="from.thread")
        hvd.allreduce(np.ones(2), name="from.main")
    hvd.shutdown()
    return "ok"
