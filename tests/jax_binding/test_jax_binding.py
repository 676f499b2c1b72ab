"""ronde.jax: collectives eager and under jit, gradients, optax equivalence, misuse.

tests/jax_binding has no __init__.py and is not called ``jax``: a package of that
name on sys.path would shadow the real jax.
"""

from __future__ import annotations

import os
import sys

import pytest

from ronde.testing.installed import skip_unless_installed

skip_unless_installed("jax", "optax")  # without importing them (ronde.testing.installed)

from ronde.testing import run_ranks, run_ranks_many  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_workers as workers  # noqa: E402

#: (optimizer, backward_passes_per_step, compression, jit) -> tolerance (float64 params)
CONFIGS = {
    ("sgd", 1, "none", True): 1e-12,
    ("adam", 1, "none", True): 1e-12,
    ("sgd", 2, "none", True): 1e-12,
    ("adam", 2, "none", False): 1e-12,
    ("sgd", 1, "fp16", True): 1e-3,
    ("adam", 1, "bf16", True): 2e-3,
}


@pytest.mark.timeout(90)
def test_collectives_eager_and_under_jit_in_one_process():
    assert run_ranks(1, workers.collectives, timeout_s=80) == ["ok"]


@pytest.mark.timeout(240)
def test_at_two_ranks_gradients_equivalence_and_the_sharded_optimizer(tmp_path):
    # one launch for the scenarios (importing JAX is most of a launch's cost)
    configs = list(CONFIGS)
    grads, per_rank, sharded, elastic, recipes = run_ranks_many(
        2, [workers.gradients, (workers.equivalence, configs), workers.sharded,
            workers.elastic_sharded_state, (workers.sharded_recipes, str(tmp_path / "ck"))],
        timeout_s=220)
    _check_recipes(recipes)
    assert grads == ["ok", "ok"]  # gradients flow through the collectives
    for diffs in per_rank:  # np=2 on batch b equals one process on batch 2b
        for cfg, diff in zip(configs, diffs):
            assert diff <= CONFIGS[cfg], (cfg, diff)
    _check_sharded(sharded, 2)
    for res in elastic:  # JaxState with a ShardedState in it
        # rank 0's parameters; each rank's own slice of the moments (rank 0's replaced
        # them before: every rank then stepped with rank 0's slice)
        assert res["params_from_0"] and res["kept"] and res["differ"], res
        assert res["kept_after_reset"], res
        assert "must not be broadcast from rank 0" in res["plain_holder"], res


@pytest.mark.timeout(200)
def test_at_three_ranks_collectives_and_the_sharded_optimizer(tmp_path):
    collectives, sharded, checkpoint, recipes = run_ranks_many(
        3, [workers.collectives, workers.sharded,
            (workers.sharded_checkpoint, str(tmp_path / "ck")),
            (workers.sharded_recipes, str(tmp_path / "recipes"))], timeout_s=180)
    _check_recipes(recipes)
    assert collectives == ["ok"] * 3  # eager and under jit
    _check_sharded(sharded, 3)
    for r, ck in enumerate(checkpoint):
        # saved at N=3 after 3 Adam steps, 3 more steps after loading at N=2 and into a
        # plain optax.adam (N=1): where the uninterrupted run ends (float64)
        if r < 2:
            assert ck["at_2"] < 1e-12, ck
        assert ck["at_1"] < 1e-12 and ck["count"] == 3, ck
        if r == 2:  # gather_sharded(root=2): the whole plain state, equal to the files'
            assert ck["gathered"] == 0.0 and ck["gathered_tree"], ck
            assert ck["gathered_count"] == 3, ck
        else:
            assert ck["gathered"] is None, ck
        assert ck["fresh_moments"] > 1e-4, ck  # the moments matter: they were loaded
        assert ck["plain_to_sharded"] < 1e-12, ck


@pytest.mark.timeout(60)
def test_differing_parameters_fail_every_rank_at_init():
    for msg, _elapsed in run_ranks(2, workers.mismatch, timeout_s=50):
        assert "['extra']['w']" in msg and "exists on rank 1 but not on rank 0" in msg, msg
        assert "same structure, shapes and dtypes" in msg


def _check_sharded(out: list[dict], np_: int) -> None:
    """ShardedOptimizer equals one process, each rank holding its share of the state."""
    params = 6 * 8 + 8 + 8 * 3 + 3  # 83
    for both in out:
        assert both["fp16_limit"] == [-40000.0] * (4 * np_), both["fp16_limit"]
        res = both["cases"]
        assert "stage=3" in res.pop("stage3")  # refused, with the stages it takes
        for opt, run in res.pop("long").items():  # 100 steps against DistributedOptimizer
            # (float64, under jit). Not bitwise even at np=2, where the reductions add the
            # same numbers in the same order: XLA compiles the update of one flat slice
            # and that of each leaf into different kernels (Adam: 1.7e-16 apart after 100
            # steps). Keras' test of the same is bitwise
            assert run["moved"] > 1e-2, (opt, run)
            assert run["params"] < 1e-14 and run["losses"] < 1e-12, (opt, run)
        assert list(res) == ["sgd.jit", "adam", "adamw.jit", "adam.jit.x2", "adam.jit.fp16",
                             "adam.jit.x2.stage2", "sgd.x2.stage2"]
        for case, r in res.items():
            if case.endswith(".fp16"):
                # gradients cast to float16 on the wire: close, and not exact (the cast
                # happened; a float64 run is otherwise within 1e-12)
                assert 1e-9 < r["diff"] < 1e-3, (case, r)
            else:
                assert r["diff"] <= 1e-12, (case, r)
            per_rank = -(-params // np_)  # elements of this rank's slice
            moments = 1 if case.startswith("sgd") else 2  # momentum; adam's mu and nu
            assert r["held"] == moments * per_rank, (case, r)
            # the accumulator of two passes: the whole gradients at stage 1, this rank's
            # slice at stage 2 (none without accumulation)
            want_acc = {"x2": params, "x2.stage2": per_rank}.get(
                case.split(".", 1)[1].removeprefix("jit.") if "." in case else "", 0)
            assert r["acc"] == want_acc, (case, r)


def _check_recipes(out: list[dict]) -> None:
    """Issue #52 items 5 and 6 (jax_workers.sharded_recipes, float64): right against one
    process on the global batches, or refused at init naming the fix."""
    for res in out:
        # chain(clip_by_global_norm, adamw) with ronde's clip: the global norm over every
        # rank's slice (optax's on a slice was 1.6e-3 off after 30 steps), and it clipped
        assert res["clip"] < 1e-12 and res["clip_spread"] == 0.0, res
        assert res["clip_mattered"] > 1e-3, res
        # optax's own clip and a mask by shape: refused at init, naming the fix
        assert "not elementwise: clip_by_global_norm" in res["optax_clip"], res
        assert "use ronde.jax.clip_by_global_norm(max_norm)" in res["optax_clip"], res
        assert "treats parameter ['l1']['w'] (shape (6, 8)) otherwise" in res["mask"], res
        assert "optax.multi_transform" in res["mask"], res
        # the fix it names: labels computed on the parameters, one ShardedOptimizer each
        assert res["labels"] < 1e-12 and res["labels_spread"] == 0.0, res
        # broadcast_optimizer_state at the start, after steps, after a load: each rank's
        # slices kept (rank 0's replaced them: 0.06 off), the step count broadcast
        assert res["slices_differ"] and res["count"] == 9, res
        assert res["broadcast"] < 1e-12 and res["broadcast_spread"] == 0.0, res
