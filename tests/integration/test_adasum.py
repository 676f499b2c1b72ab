"""op=Adasum on real ranks (2, 3 and 4: ronde takes counts that are not powers of two,
by the rule of ``collectives/adasum.py``), against the numpy reference tree."""

from __future__ import annotations

import numpy as np
import pytest

from ronde.collectives import adasum
from ronde.testing import run_ranks, run_ranks_many

from . import workers


@pytest.mark.timeout(120)
def test_adasum_matches_the_reference_tree_at_four_ranks():
    assert run_ranks(4, workers.adasum_cases, timeout_s=100) == ["ok"] * 4


def test_the_pairwise_rule():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    np.testing.assert_allclose(adasum.pair(a, b), a + b)        # orthogonal: sum
    np.testing.assert_allclose(adasum.pair(a, 3 * a), 2 * a)    # parallel: the mean
    c = np.array([1.0, 1.0])  # in between: a.b = 1, |a|^2 = 1, |c|^2 = 2
    np.testing.assert_allclose(adasum.pair(a, c), 0.5 * a + 0.75 * c)
    np.testing.assert_allclose(adasum.pair(np.zeros(2), c), c)  # a zero vector: no 0/0


def test_the_tree_pairs_neighbours_and_lifts_the_odd_one():
    v = [np.array([1.0, 0, 0]), np.array([0, 1.0, 0]), np.array([0, 0, 1.0])]
    np.testing.assert_allclose(adasum.tree(v), [1, 1, 1])  # ((0, 1), 2), all orthogonal
    four = [np.array([k + 1.0, 1.0]) for k in range(4)]
    want = adasum.pair(adasum.pair(four[0], four[1]), adasum.pair(four[2], four[3]))
    np.testing.assert_allclose(adasum.tree(four), want)


@pytest.mark.timeout(300)
def test_at_two_ranks_the_tree_and_the_delta_optimizers_of_every_binding():
    # one launch for the two-rank scenarios (importing the frameworks is most of a
    # launch's cost)
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    pytest.importorskip("tensorflow")
    cases, parallel, different, bindings, jax_optimizer = run_ranks_many(2, [
        workers.adasum_cases, (workers.torch_adasum_optimizer, True),
        (workers.torch_adasum_optimizer, False), workers.adasum_bindings,
        workers.jax_adasum_optimizer], timeout_s=280)
    assert cases == ["ok"] * 2  # the reference tree
    # torch's delta optimizer: the same weights on both ranks, on the same data and not
    assert parallel[0] == parallel[1] and different[0] == different[1]
    assert bindings == ["ok"] * 2  # through the JAX and TensorFlow bindings
    assert jax_optimizer == ["ok"] * 2  # JAX's delta optimizer


@pytest.mark.timeout(200)
def test_at_three_ranks_the_tree_and_jaxs_delta_optimizer():
    pytest.importorskip("optax")
    cases, jax_optimizer = run_ranks_many(
        3, [workers.adasum_cases, workers.jax_adasum_optimizer], timeout_s=180)
    assert cases == ["ok"] * 3 and jax_optimizer == ["ok"] * 3
