"""op=Adasum on real ranks (2, 3 and 4: ronde takes counts that are not powers of two,
by the rule of ``collectives/adasum.py``), against the numpy reference tree."""

from __future__ import annotations

import numpy as np
import pytest

from ronde.collectives import adasum
from ronde.testing import run_ranks

from . import workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_adasum_matches_the_reference_tree(np_):
    assert run_ranks(np_, workers.adasum_cases, timeout_s=100) == ["ok"] * np_


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("same_data", [True, False], ids=["parallel", "different"])
def test_the_torch_delta_optimizer(same_data):
    pytest.importorskip("torch")
    got = run_ranks(2, workers.torch_adasum_optimizer, same_data, timeout_s=100)
    assert got[0] == got[1]


@pytest.mark.timeout(180)
def test_adasum_through_the_jax_and_tensorflow_bindings():
    pytest.importorskip("jax")
    pytest.importorskip("tensorflow")
    assert run_ranks(2, workers.adasum_bindings, timeout_s=150) == ["ok"] * 2


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_the_jax_delta_optimizer(np_):
    pytest.importorskip("optax")
    assert run_ranks(np_, workers.jax_adasum_optimizer, timeout_s=140) == ["ok"] * np_
