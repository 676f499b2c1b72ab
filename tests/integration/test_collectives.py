"""Real processes through ronde's launcher, over the real transports."""

from __future__ import annotations

import ctypes

import pytest

from ronde.testing import run_ranks

from . import workers

from ronde import gloo_built

#: every transport available here runs the same tests (gloo needs torch)
TRANSPORTS = ["shm", "tcp"] + (["gloo"] if gloo_built() else [])


def _env(transport: str, **extra: str) -> dict[str, str]:
    """The environment of a transport's run. ``tcp`` stands for ranks on different
    hosts, so its negotiation goes over the sockets too (no shared-memory mailboxes)."""
    env = {"RONDE_TRANSPORT": transport, **extra}
    if transport == "tcp":
        env["RONDE_SHM_CONTROL"] = "0"
    return env


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("np_", [2, 3])
def test_every_collective_matches_numpy(np_, transport):
    assert run_ranks(np_, workers.collectives, timeout_s=150,
                     env=_env(transport)) == ["ok"] * np_


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_collective_at_np4(transport):
    assert run_ranks(4, workers.collectives, timeout_s=170,
                     env=_env(transport)) == ["ok"] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_shape_mismatch_fails_every_rank_within_seconds(np_):
    run_ranks(np_, workers.mismatch, timeout_s=50)  # the test's timeout bounds it


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_join_with_uneven_batches(transport):
    last = run_ranks(3, workers.join_uneven, timeout_s=50, env=_env(transport))
    assert last == [2, 2, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_process_sets(transport):
    ids = run_ranks(4, workers.process_sets, timeout_s=50, env=_env(transport))
    assert all(i == ids[0] for i in ids) and ids[0][0] != ids[0][1]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_then_init_again_is_quick(transport):
    worst = run_ranks(2, workers.reinit, timeout_s=80, env=_env(transport))
    # a Gloo process group takes a few seconds to build; ronde's own transports do not
    assert max(worst) < (15.0 if transport == "gloo" else 5.0)


@pytest.mark.timeout(60)
def test_topology_single_host():
    out = run_ranks(3, workers.topology, timeout_s=50)
    assert [o[0] for o in out] == [0, 1, 2]
    assert all(o[1] == 3 and o[3] == 3 and o[5] == 1 and o[6] for o in out)
    assert [o[2] for o in out] == [0, 1, 2]
    assert all(o[7] == "shm" for o in out)
    # more ranks than cores here: nobody spins and rounds are held longer (the knobs
    # unset), else 200 us and 50 ms
    assert all((o[8], o[10]) == ((0.0, 0.05 * -(-3 // o[9])) if 3 > o[9] else (200e-6, 0.05))
               for o in out), out
    out = run_ranks(3, workers.topology, timeout_s=50,
                    env={"RONDE_SPIN_TIME": "100", "RONDE_ROUND_HOLD": "20"})
    assert all((o[8], o[10]) == (100e-6, 0.02) for o in out), out  # set: kept


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_misuse_fails_fast_instead_of_hanging(transport):
    assert run_ranks(3, workers.misuse, timeout_s=50,
                     env=_env(transport)) == ["ok"] * 3


@pytest.mark.timeout(60)
def test_stall_shutdown_time_zero_means_never():
    # Horovod users write 0 for "disabled"; it once made every round time out at once
    assert run_ranks(2, workers.plain_allreduce, timeout_s=50,
                     env={"RONDE_STALL_SHUTDOWN_TIME": "0"}) == [2.0, 2.0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("inline", ["4096", "0"])
def test_steady_state_with_and_without_inline_data(transport, inline):
    env = _env(transport, RONDE_INLINE_BYTES=inline)
    assert run_ranks(3, workers.steady_state, timeout_s=80, env=env) == ["ok"] * 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,cma", [("shm", "1"), ("shm", "0"), ("tcp", "1")])
@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("threshold", ["64MiB", "300KiB"])  # one fused group, or several
def test_fused_large_tensors(transport, cma, np_, threshold):
    env = _env(transport, RONDE_CMA=cma, RONDE_FUSION_THRESHOLD=threshold)
    assert run_ranks(np_, workers.fused_large, timeout_s=100, env=env) == ["ok"] * np_


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hugepages", ["1", "0"])
def test_tensors_read_in_place_move_onto_huge_pages_values_exact(hugepages, monkeypatch):
    from ronde.transport.hugepages import HugePages

    # exec'd ranks: malloc's thresholds are per process, and a rank forked from the
    # suite's zygote (tests/conftest.py) inherits a heap that imported torch already
    monkeypatch.setenv("RONDE_TESTING_PRELOAD", "")

    got = run_ranks(3, workers.hugepages_steady, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm", "RONDE_HUGEPAGES": hugepages})
    if hugepages == "0" or not HugePages(True).active:
        # memory and malloc left alone
        assert [tuple(g) for g in got] == [(False, 0, False, False)] * 3
    else:
        glibc = hasattr(ctypes.CDLL(None), "gnu_get_libc_version")
        for active, collapsed, tuned, on_heap in got:
            assert active and collapsed > 0
            # init() set malloc's thresholds: a 1 MiB tensor comes from the heap
            assert tuned == on_heap == glibc


@pytest.mark.timeout(60)
def test_a_slow_owners_block_is_gathered_chunk_by_chunk_never_early():
    got = run_ranks(2, workers.slow_owner_progressive, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm"})
    assert got[0] >= 2, got  # rank 0 read rank 1's block in pieces, as they were ready


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_owners_write_reduced_chunks_into_every_peer_and_nobody_reads_them_back(np_):
    got = run_ranks(np_, workers.owners_push_reduced_chunks, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm", "RONDE_FUSION_THRESHOLD": "64MiB"})
    for reads, writes in got:
        # one fused op of 7.8 MiB: a block of 7.8/n MiB covers 2-5 chunks of 1 MiB (they
        # lie on a grid fixed in the vector, so a block may begin and end in part of
        # one); each chunk is read from every peer (reduce-scatter) and written into
        # every peer (gather)
        assert reads == writes, got
        chunks = reads // (np_ - 1)
        assert chunks * (np_ - 1) == reads and 2 <= chunks <= 5, got


@pytest.mark.timeout(60)
def test_a_slow_owners_block_shrinks_on_every_rank_alike_values_exact():
    got = run_ranks(3, workers.slow_owner_block_shrinks, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm"})
    assert got[0] == got[1] == got[2], got
    sizes = got[0]
    assert sum(sizes) == 3 << 20 and sizes[1] < 0.75 * min(sizes[0], sizes[2]), sizes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [2, 3])
def test_chunk_plans_are_built_once_per_tensor_set_while_blocks_move(np_):
    got = run_ranks(np_, workers.chunk_plans_reused, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm", "RONDE_FUSION_THRESHOLD": "64MiB"})
    for counts, layout_sets, ops in got:
        # a whole chunk's plan once for each set of layouts, however often it ran (a
        # block's partial first and last chunks, whose edges move, are rebuilt); the
        # two sets alternate over 12 ops, each submitted together (one round); a rank
        # whose blocks held no whole chunk of one set built plans for the other only
        assert counts and all(c == 1 for c in counts), got
        assert 1 <= layout_sets <= 2 and ops == 12, got


@pytest.mark.timeout(60)
def test_large_alltoall_reducescatter_allgather_broadcast_copy_between_peers_in_place():
    got = run_ranks(3, workers.single_copy_collectives_taken, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm"})
    want = {"alltoallv": 1, "reducescatter": 1, "allgatherv": 1, "broadcast": 1,
            "writes": 2}  # the allgather's, one into each peer
    assert got == [want] * 3, got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("np_", [3, 4])
@pytest.mark.parametrize("cma", ["1", "0"], ids=["single-copy", "segments"])
def test_shm_allreduce_sums_in_rank_order_bit_for_bit(np_, cma):
    env = {"RONDE_TRANSPORT": "shm", "RONDE_FUSION_THRESHOLD": "64MiB", "RONDE_CMA": cma}
    assert run_ranks(np_, workers.rank_order_sums, timeout_s=50, env=env) == ["ok"] * np_


@pytest.mark.timeout(60)
def test_single_copy_path_is_agreed_by_every_rank():
    assert run_ranks(3, workers.cma_denied_on_one_rank, timeout_s=50,
                     env={"RONDE_TRANSPORT": "shm"}) == [False, False, False]
    got = run_ranks(3, workers.cma_write_denied_on_one_rank, timeout_s=50,
                    env={"RONDE_TRANSPORT": "shm"})
    assert [tuple(g) for g in got] == [(True, False)] * 3  # reads in place, nobody pushes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_round_frames_larger_than_a_mailbox_slot(np_):
    assert run_ranks(np_, workers.many_new_names, timeout_s=100) == ["ok"] * np_


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env", [{}, {"RONDE_SHM_CONTROL": "0"}, {"RONDE_SPIN_TIME": "0"}],
                         ids=["drive+mailbox", "drive+sockets", "threads-only"])
def test_several_threads_waiting_at_once(env):
    assert run_ranks(3, workers.threads_waiting, timeout_s=100, env=env) == ["ok"] * 3


@pytest.mark.timeout(180)
def test_every_collective_without_callers_driving():
    # RONDE_SPIN_TIME=0: waiting callers block at once and the engine's own threads
    # negotiate and move every byte (the path asynchronous work always takes)
    assert run_ranks(3, workers.collectives, timeout_s=150,
                     env={"RONDE_SPIN_TIME": "0"}) == ["ok"] * 3


@pytest.mark.timeout(180)
def test_every_collective_through_shared_segments_only():
    # RONDE_CMA=0 (or a container without ptrace rights): large allreduce, allgather
    # and broadcast go through the shared segments instead of single-copy reads
    assert run_ranks(3, workers.collectives, timeout_s=150,
                     env={"RONDE_TRANSPORT": "shm", "RONDE_CMA": "0"}) == ["ok"] * 3
