"""Block sizes of the single-copy allreduce, balanced by measured owner times."""

from ronde.transport.balance import ALIGN_BYTES, MIN_SHARE, BlockSplit, even


def _check(blocks, total):
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    for (a, b), (c, _) in zip(blocks, blocks[1:]):
        assert a <= b == c


def test_a_new_key_gets_equal_blocks():
    assert BlockSplit(3).blocks(("k",), 10, 4) == even(10, 3) == [(0, 4), (4, 7), (7, 10)]


def test_a_slower_owner_gets_a_smaller_block_until_times_are_equal():
    split, total, key = BlockSplit(2), 1 << 20, ("x",)
    cost = [2.0, 1.0]  # seconds per element: owner 0 is twice as slow
    for _ in range(12):
        used = split.blocks(key, total, 4)
        _check(used, total)
        split.update(key, total, used, [c * (hi - lo) for c, (lo, hi) in zip(cost, used)])
    (a, b), (c, d) = split.blocks(key, total, 4)
    assert abs((b - a) / total - 1 / 3) < 0.01  # equal times: 1/3 for the slow owner
    assert b % (ALIGN_BYTES // 4) == 0  # boundaries fall on whole cache lines


def test_every_rank_derives_the_same_blocks_from_the_same_times():
    ranks = [BlockSplit(3) for _ in range(3)]
    times = [[0.003, 0.001, 0.002], [0.0011, 0.0013, 0.0009], [0.5, 1e-9, 0.2]]
    for t in times:
        used = [s.blocks(("y",), 999_999, 8) for s in ranks]
        assert used[0] == used[1] == used[2]
        for s in ranks:
            s.update(("y",), 999_999, used[0], t)


def test_no_block_shrinks_below_its_floor_and_odd_times_are_harmless():
    split, total = BlockSplit(4), 4_000_000
    for t in ([10.0, 1e-9, 1e-9, 1e-9], [0.0, 0.0, 0.0, 0.0], [1e12, 1.0, 1.0, 1.0]):
        used = split.blocks(("z",), total, 4)
        split.update(("z",), total, used, t)
    blocks = split.blocks(("z",), total, 4)
    _check(blocks, total)
    assert min(b - a for a, b in blocks) >= MIN_SHARE / 4 * total * 0.95


def test_keys_are_balanced_apart_and_the_oldest_is_forgotten():
    from ronde.transport import balance

    split = BlockSplit(2)
    split.update(("slow0",), 100, [(0, 50), (50, 100)], [2.0, 1.0])
    split.update(("slow1",), 100, [(0, 50), (50, 100)], [1.0, 2.0])
    a, b = split.blocks(("slow0",), 100, 1), split.blocks(("slow1",), 100, 1)
    assert a[0][1] < 50 < b[0][1]
    for i in range(balance.CAPACITY):
        split.update((i,), 100, [(0, 50), (50, 100)], [1.0, 1.0])
    assert split.blocks(("slow0",), 100, 1) == even(100, 2)
