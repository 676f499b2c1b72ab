"""The collective algorithms against a plain numpy reference, threads as ranks.

Every case checks the value (exact for integers and MIN/MAX, ``assert_allclose``
against the rank-order reduction for floating sums and products) and that all
ranks hold bitwise-identical bytes.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from ronde.collectives import (
    ReduceOp,
    allgatherv,
    allgatherv_bruck,
    allgatherv_direct,
    allgatherv_ring,
    allreduce,
    allreduce_recursive_doubling,
    allreduce_ring,
    alltoallv,
    barrier,
    broadcast,
    broadcast_binomial,
    broadcast_chain,
    reducescatter,
)
from ronde.transport.loopback import LoopbackGroup, run_threads

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - optional dependency
    BF16 = None

SIZES = [1, 2, 3, 4, 5]
LENGTHS = [0, 1, 2, 3, 7, 1000, 100003]
OPS = [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
DTYPES: list[Any] = [np.int32, np.int64, np.uint8, np.float16, np.float32, np.float64]
if BF16 is not None:
    DTYPES.append(BF16)
UFUNC = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}
RTOL = {np.dtype(np.float16): 1e-2, np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}
if BF16 is not None:
    RTOL[np.dtype(BF16)] = 2e-2


def is_float(dtype: Any) -> bool:
    return np.dtype(dtype) in RTOL


def make_inputs(size: int, length: int, dtype: Any, op: ReduceOp, seed: int = 0) -> list[np.ndarray]:
    """Per-rank inputs whose reduction cannot overflow or cancel badly."""
    rng = np.random.default_rng([seed, size, length, int(op)])
    out = []
    for _ in range(size):
        if is_float(dtype):
            if op in (ReduceOp.MIN, ReduceOp.MAX):
                x = rng.uniform(-2.0, 2.0, length)
            else:
                x = rng.uniform(0.5, 2.0, length)
        elif op == ReduceOp.PRODUCT:
            x = rng.integers(1, 3, length)
        elif op == ReduceOp.SUM:
            x = rng.integers(0, 4, length)
        else:
            lo = 0 if np.dtype(dtype).kind == "u" else -100
            x = rng.integers(lo, 200, length)
        out.append(x.astype(dtype))
    return out


def reference(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    ref = inputs[0].copy()
    for x in inputs[1:]:
        UFUNC[op](ref, x, out=ref)
    return ref


def check_result(results: list[np.ndarray], ref: np.ndarray, op: ReduceOp, what: str) -> None:
    first = results[0].tobytes()
    for rank, res in enumerate(results):
        assert res.dtype == ref.dtype and res.shape == ref.shape, what
        assert res.tobytes() == first, f"{what}: rank {rank} differs bitwise from rank 0"
    if is_float(ref.dtype) and op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        np.testing.assert_allclose(
            results[0].astype(np.float64), ref.astype(np.float64), rtol=RTOL[ref.dtype], err_msg=what
        )
    else:
        np.testing.assert_array_equal(results[0].astype(np.float64), ref.astype(np.float64), err_msg=what)


def counts_patterns(total: int, size: int) -> list[list[int]]:
    """Even, everything-on-the-last-rank, and a random split with zeros."""
    base, extra = divmod(total, size)
    even = [base + (i < extra) for i in range(size)]
    last = [0] * (size - 1) + [total]
    rng = np.random.default_rng([total, size])
    cuts = np.sort(rng.integers(0, total + 1, size - 1))
    bounds = [0, *cuts.tolist(), total]
    rand = [bounds[i + 1] - bounds[i] for i in range(size)]
    if size > 1:
        rand[0], rand[-1] = rand[0] + rand[-1], 0
    return [even, last, rand]


def run_cases(size: int, cases: list[Any], fn: Callable[[Any, Any], Any]) -> list[list[Any]]:
    """``fn(endpoint, case)`` for every case, all in one loopback launch; per case, the
    ranks' results in rank order.

    One launch per case started hundreds of thread sets a test: on a starved CPU (the
    MXNet venv's run, at nice 15 beside the main run) each start and join waits for the
    scheduler, and test_reducescatter[4]'s 441 launches took it past its 60 s
    (0.65 s unstarved). A rank's failure names its case.
    """

    def body(ep: Any) -> list[Any]:
        out = []
        for case in cases:
            try:
                out.append(fn(ep, case))
            except Exception as exc:
                raise AssertionError(f"rank {ep.rank}, case {case[0]}: {exc!r}") from exc
        return out

    per_rank = run_threads(size, body, timeout_s=50.0)
    return [[per_rank[r][i] for r in range(size)] for i in range(len(cases))]


def in_place(fn: Callable[..., None]) -> Callable[[Any, Any], np.ndarray]:
    """A case body for ``(what, arg, inputs)``: ``fn(endpoint, buf, arg)`` on a copy of
    this rank's input (``arg``: an op, a root), the copy returned."""

    def body(ep: Any, case: Any) -> np.ndarray:
        _, arg, inputs = case
        buf = inputs[ep.rank].copy()
        fn(ep, buf, arg)
        return buf

    return body


# -- allreduce ---------------------------------------------------------------

ALLREDUCE_ALGOS: dict[str, Callable[..., None]] = {
    "ring": functools.partial(allreduce_ring, piece_bytes=64 * 1024),
    "recursive_doubling": allreduce_recursive_doubling,
    "auto": allreduce,
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", list(ALLREDUCE_ALGOS))
def test_allreduce(algo: str, size: int) -> None:
    fn = ALLREDUCE_ALGOS[algo]
    cases = []
    for dtype in DTYPES:
        for op in OPS:
            for length in LENGTHS:
                if length == LENGTHS[-1] and op != ReduceOp.SUM and dtype not in (np.float32, np.int32):
                    continue  # the long case: every dtype for SUM, every op for two dtypes
                what = f"{algo} n={size} {np.dtype(dtype).name} {op.name} len={length}"
                cases.append((what, op, make_inputs(size, length, dtype, op)))

    for (what, op, inputs), results in zip(cases, run_cases(size, cases, in_place(fn))):
        check_result(results, reference(inputs, op), op, what)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 5])
def test_allreduce_ring_tiny_pieces(size: int) -> None:
    """Pieces of 3 elements: uneven blocks end in partial and empty pieces."""
    for length in [2, 11, 31]:
        inputs = make_inputs(size, length, np.float64, ReduceOp.SUM)

        def body(ep: Any) -> np.ndarray:
            buf = inputs[ep.rank].copy()
            allreduce_ring(ep, buf, ReduceOp.SUM, piece_bytes=24)
            return buf

        check_result(run_threads(size, body), reference(inputs, ReduceOp.SUM), ReduceOp.SUM, f"len={length}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["ring", "recursive_doubling"])
def test_allreduce_signed_zero_min_is_bitwise_identical(algo: str) -> None:
    """np.minimum(+0.0, -0.0) returns an operand depending on order; ranks must agree."""
    fn = ALLREDUCE_ALGOS[algo]
    for size in [2, 3, 4, 5]:
        for op in [ReduceOp.MIN, ReduceOp.MAX]:

            def body(ep: Any) -> bytes:
                buf = np.array([0.0 if (ep.rank + i) % 2 else -0.0 for i in range(8)])
                fn(ep, buf, op)
                return buf.tobytes()

            results = run_threads(size, body)
            assert results.count(results[0]) == size, (size, op)


@pytest.mark.timeout(60)
def test_allreduce_average_reduces_as_sum_and_adasum_is_refused() -> None:
    def body(ep: Any) -> np.ndarray:
        buf = np.full(5, ep.rank + 1, dtype=np.int64)
        allreduce(ep, buf, ReduceOp.AVERAGE)
        return buf

    assert [r.tolist() for r in run_threads(3, body)] == [[6] * 5] * 3

    with pytest.raises(ValueError, match="ADASUM is not elementwise"):
        allreduce(LoopbackGroup(1).endpoint(0), np.zeros(3), ReduceOp.ADASUM)
    with pytest.raises(ValueError, match="not C-contiguous"):
        allreduce(LoopbackGroup(1).endpoint(0), np.zeros((4, 4))[:, 0], ReduceOp.SUM)


# -- reducescatter -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_reducescatter(size: int) -> None:
    cases = []
    for dtype in DTYPES:
        for op in OPS:
            for length in [0, 1, 3, 7, 1000, 100003]:
                if length == 100003 and op != ReduceOp.SUM:
                    continue
                inputs = make_inputs(size, length, dtype, op, seed=1)
                for counts in counts_patterns(length, size):
                    what = f"n={size} {np.dtype(dtype).name} {op.name} counts={counts}"
                    cases.append((what, op, inputs, counts))

    def body(ep: Any, case: Any) -> np.ndarray:
        _, op, inputs, counts = case
        buf = inputs[ep.rank].copy()
        out = reducescatter(ep, buf, counts, op, piece_bytes=16 * 1024)
        np.testing.assert_array_equal(buf, inputs[ep.rank])  # input untouched
        return out

    for (what, op, inputs, counts), results in zip(cases, run_cases(size, cases, body)):
        ref, offs = reference(inputs, op), np.cumsum([0, *counts])
        for rank, res in enumerate(results):
            check_result([res], ref[offs[rank] : offs[rank + 1]], op, f"{what} rank {rank}")


@pytest.mark.timeout(60)
def test_reducescatter_rejects_bad_counts() -> None:
    ep = LoopbackGroup(1).endpoint(0)
    with pytest.raises(ValueError, match="sum to 3, but the buffer has 4"):
        reducescatter(ep, np.zeros(4), [3], ReduceOp.SUM)
    with pytest.raises(ValueError, match="got 2 counts for a group of 1"):
        reducescatter(ep, np.zeros(4), [2, 2], ReduceOp.SUM)


# -- allgatherv ----------------------------------------------------------------

ALLGATHER_ALGOS: dict[str, Callable[..., None]] = {
    "ring": allgatherv_ring,
    "direct": allgatherv_direct,
    "bruck": allgatherv_bruck,
    "auto": functools.partial(allgatherv, small_bytes=1024),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", list(ALLGATHER_ALGOS))
def test_allgatherv(algo: str, size: int) -> None:
    fn = ALLGATHER_ALGOS[algo]
    cases = []
    for dtype in DTYPES:
        for length in LENGTHS:
            full = make_inputs(1, length, dtype, ReduceOp.MAX, seed=2)[0]
            for counts in counts_patterns(length, size):
                cases.append((f"{algo} n={size} counts={counts}", full, counts))

    def body(ep: Any, case: Any) -> np.ndarray:
        _, full, counts = case
        offs = np.cumsum([0, *counts])
        recv = np.zeros(len(full), dtype=full.dtype)
        fn(ep, full[offs[ep.rank] : offs[ep.rank + 1]].copy(), recv, counts)
        return recv

    for (what, full, _), results in zip(cases, run_cases(size, cases, body)):
        check_result(results, full, ReduceOp.MAX, what)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [6, 7, 8, 9])
def test_bruck_allgatherv_beyond_a_power_of_two(size: int) -> None:
    # the last step sends fewer blocks than the rank holds (n not a power of two)
    for length in (0, size - 1, 3 * size + 2):
        full = make_inputs(1, length, np.float32, ReduceOp.MAX, seed=5)[0]
        for counts in counts_patterns(length, size):
            offs = np.cumsum([0, *counts])

            def body(ep: Any) -> np.ndarray:
                recv = np.zeros(length, dtype=np.float32)
                allgatherv_bruck(ep, full[offs[ep.rank]: offs[ep.rank + 1]].copy(), recv,
                                 counts)
                return recv

            check_result(run_threads(size, body), full, ReduceOp.MAX,
                         f"bruck n={size} counts={counts}")


@pytest.mark.timeout(60)
def test_allgatherv_rejects_wrong_send_length() -> None:
    ep = LoopbackGroup(1).endpoint(0)
    with pytest.raises(ValueError, match=r"rank 0 sends 2 elements but counts\[0\] is 3"):
        allgatherv(ep, np.zeros(2), np.zeros(3), [3])


# -- broadcast -----------------------------------------------------------------

BROADCAST_ALGOS: dict[str, Callable[..., None]] = {
    "binomial": broadcast_binomial,
    "chain": functools.partial(broadcast_chain, piece_bytes=1000),
    "auto": functools.partial(broadcast, large_bytes=4096, piece_bytes=4096),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algo", list(BROADCAST_ALGOS))
def test_broadcast_every_root(algo: str, size: int) -> None:
    fn = BROADCAST_ALGOS[algo]
    cases = []
    for dtype in [np.uint8, np.float16, np.float64] + ([BF16] if BF16 is not None else []):
        for length in LENGTHS:
            data = make_inputs(size, length, dtype, ReduceOp.MAX, seed=3)
            cases += [(f"{algo} n={size} root={root}", root, data) for root in range(size)]

    for (what, root, data), results in zip(cases, run_cases(size, cases, in_place(fn))):
        check_result(results, data[root], ReduceOp.MAX, what)


@pytest.mark.timeout(60)
def test_broadcast_rejects_bad_root() -> None:
    with pytest.raises(ValueError, match="root 2 is outside 0..0"):
        broadcast(LoopbackGroup(1).endpoint(0), np.zeros(3), 2)


# -- alltoallv -----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_alltoallv(size: int) -> None:
    cases = []
    for dtype in DTYPES:
        for scale in [0, 1, 3, 1000, 20000]:
            rng = np.random.default_rng([size, scale])
            matrix = rng.integers(0, scale + 1, (size, size))  # matrix[i, j]: elements i -> j
            if size > 1:
                matrix[0, 1] = 0
            sends = [
                (np.arange(matrix[i].sum()) % 97 + 100 * i).astype(dtype) if matrix[i].sum() else np.zeros(0, dtype)
                for i in range(size)
            ]
            cases.append((f"n={size} {np.dtype(dtype).name} scale={scale}", matrix, sends))

    def body(ep: Any, case: Any) -> np.ndarray:
        _, matrix, sends = case
        r = ep.rank
        recv = np.zeros(int(matrix[:, r].sum()), dtype=sends[r].dtype)
        alltoallv(ep, sends[r].copy(), matrix[r].tolist(), recv, matrix[:, r].tolist())
        return recv

    for (what, matrix, sends), results in zip(cases, run_cases(size, cases, body)):
        for r, res in enumerate(results):
            expect = [sends[i][matrix[i, :r].sum() : matrix[i, : r + 1].sum()] for i in range(size)]
            np.testing.assert_array_equal(
                res.astype(np.float64), np.concatenate(expect).astype(np.float64), err_msg=f"{what} rank {r}"
            )


# -- barrier -------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_barrier_waits_for_everyone(size: int) -> None:
    arrived = [0] * size
    lock = threading.Lock()

    def body(ep: Any) -> list[int]:
        seen = []
        for round_ in range(3):
            time.sleep(0.002 * ((ep.rank * 7 + round_) % size))
            with lock:
                arrived[ep.rank] += 1
            barrier(ep)
            with lock:
                seen.append(min(arrived))
            barrier(ep)  # nobody starts the next round before everyone checked
        return seen

    for seen in run_threads(size, body):
        assert seen == [1, 2, 3]


# -- loopback transport --------------------------------------------------------


@pytest.mark.timeout(60)
def test_loopback_checks_lengths_and_propagates_errors() -> None:
    def body(ep: Any) -> None:
        if ep.rank == 0:
            ep.send(1, memoryview(bytes(4)))
        else:
            ep.recv(0, memoryview(bytearray(8)))

    with pytest.raises(ValueError, match="expected 8 bytes, the message has 4"):
        run_threads(2, body)


@pytest.mark.timeout(60)
def test_loopback_reports_a_hang() -> None:
    def body(ep: Any) -> None:
        ep.recv((ep.rank + 1) % ep.size, memoryview(bytearray(1)))

    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 0.3 s"):
        run_threads(2, body, timeout_s=0.3)


@pytest.mark.timeout(60)
def test_loopback_fifo_and_zero_length() -> None:
    def body(ep: Any) -> list[bytes]:
        peer = 1 - ep.rank
        for i in range(5):
            ep.send(peer, memoryview(bytes([i, ep.rank])))
        ep.send(peer, memoryview(b""))
        ep.recv(peer, memoryview(bytearray(0)))
        out = []
        for _ in range(5):
            b = bytearray(2)
            ep.recv(peer, memoryview(b))
            out.append(bytes(b))
        return out

    a, b = run_threads(2, body)
    assert a == [bytes([i, 1]) for i in range(5)]
    assert b == [bytes([i, 0]) for i in range(5)]


def test_average_runs_as_a_sum_with_the_postscale_divided() -> None:
    # one rule for the executor's allreduce and reducescatter and the inline reduction
    from ronde.collectives.ops import as_sum

    assert as_sum(ReduceOp.AVERAGE, 0.5, 4) == (ReduceOp.SUM, 0.125)
    assert as_sum(ReduceOp.MAX, 0.5, 4) == (ReduceOp.MAX, 0.5)


def test_a_failed_collective_fails_each_member_request_with_a_ronde_error() -> None:
    from ronde import RondeError, TensorMismatchError
    from ronde.core.requests import fail_all

    class Req:
        def __init__(self, name: str) -> None:
            self.name, self.error = name, None

        def fail(self, exc: BaseException) -> None:
            self.error = exc

    a, b = Req("a"), Req("b")
    fail_all([a, None, b], ValueError("bad"), "allreduce")  # None: not a member
    assert type(a.error) is RondeError and str(a.error) == "allreduce 'a' failed: ValueError('bad')"
    mismatch = TensorMismatchError("shape differs")
    fail_all([a], mismatch, "allreduce")
    assert a.error is mismatch  # ronde's own errors as they are
