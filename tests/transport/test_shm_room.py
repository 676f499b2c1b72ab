"""What each host's /dev/shm holds, decided from the rendezvous table (shm_room.plan), and
the transport every rank then chooses (factory.choose). A job with a container's default
64 MiB /dev/shm failed at init() once segments were reserved in full (about 260 MiB at
np=2); now its segments shrink, or its ranks run over tcp, with a warning."""

from __future__ import annotations

import platform

import pytest

from ronde import ConfigError
from ronde._config import Config
from ronde.transport import factory
from ronde.transport.mailbox import SEGMENT_BYTES as MAILBOX
from ronde.transport.segments import Names, shm_dir
from ronde.transport.shm.protocol import segment_total
from ronde.transport.shm_room import FLOOR_BYTES, Room, plan

MIB = 1 << 20
pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"),
    reason="the shm transport and the mailboxes exist on x86-64 only")


def test_a_host_with_room_keeps_the_configuration():
    need = 2 * (2 * segment_total(64 * MIB) + MAILBOX)
    room = plan(Config(), ["a", "a"], [need, need + 1], {"a"})
    assert room == Room()


def test_a_containers_default_dev_shm_shrinks_the_segments_with_a_warning():
    room = plan(Config(), ["a", "a"], [64 * MIB, 64 * MIB], {"a"})
    size = room.segment_bytes["a"]
    # at most half of the free space: 2 ranks x (2 segments + a mailbox)
    assert FLOOR_BYTES <= size < 64 * MIB and size % MIB == 0
    assert 2 * (2 * segment_total(size) + MAILBOX) <= 32 * MIB
    assert 2 * (2 * segment_total(size + MIB) + MAILBOX) > 32 * MIB
    assert not room.no_shm and not room.no_mailboxes
    assert room.config(Config(), "a").shm_segment_bytes == size
    assert room.config(Config(), "a").shm_control == "auto"
    text = room.warnings["a"]
    need = 2 * (2 * segment_total(64 * MIB) + MAILBOX)
    for part in (f"{shm_dir()} has {64 * MIB} bytes free on host a", f"needs {need} bytes",
                 "RONDE_SHM_SEGMENT=64MiB", f"running with {size // MIB}MiB segments",
                 "--shm-size=1g", f"mount -o remount,size=1G {shm_dir()}",
                 "RONDE_TRANSPORT=tcp"):
        assert part in text, text


def test_the_least_free_space_any_rank_of_the_host_saw_decides():
    one = plan(Config(), ["a", "a", "a"], [64 * MIB, 1 << 40, 64 * MIB], {"a"})
    other = plan(Config(), ["a", "a", "a"], [1 << 40, 1 << 40, 64 * MIB], {"a"})
    assert one.segment_bytes == other.segment_bytes and "a" in one.segment_bytes


def test_too_little_for_the_floor_means_tcp_and_no_mailboxes_where_they_do_not_fit():
    room = plan(Config(), ["a", "a"], [3 * MIB, 3 * MIB], {"a"})
    assert "a" in room.no_shm and "a" not in room.segment_bytes
    assert room.no_mailboxes == frozenset({"a"})  # 2 x 1 MiB > half of 3 MiB
    assert room.config(Config(), "a").shm_control == "off"
    assert "run over tcp" in room.warnings["a"]
    # mailboxes alone fit in half of 6 MiB: they stay
    room = plan(Config(), ["a", "a"], [6 * MIB, 6 * MIB], {"a"})
    assert "a" in room.no_shm and not room.no_mailboxes


def test_only_the_cramped_host_changes_and_one_rank_hosts_need_nothing():
    hosts = ["a", "a", "b", "b", "c"]
    room = plan(Config(), hosts, [1 << 40, 1 << 40, 64 * MIB, 64 * MIB, 0], {"a", "b"})
    # several hosts: no steady lane, one segment a rank (the hierarchical local part)
    size = room.segment_bytes["b"]
    assert 2 * (segment_total(size) + MAILBOX) <= 32 * MIB < 2 * (segment_total(size + MIB)
                                                                 + MAILBOX)
    assert set(room.segment_bytes) == {"b"} and set(room.warnings) == {"b"}
    assert not room.no_shm


def test_unknown_or_malformed_free_space_changes_nothing():
    for free in ([None, None], ["64", -1], [True, 2.5]):
        assert plan(Config(), ["a", "a"], free, {"a"}) == Room()


def test_over_tcp_only_the_mailboxes_count_and_nothing_is_warned():
    cfg = Config(transport="tcp")
    assert plan(cfg, ["a", "a"], [64 * MIB, 64 * MIB], {"a"}) == Room()
    room = plan(cfg, ["a", "a"], [MIB, MIB], {"a"})
    assert room.no_mailboxes == frozenset({"a"}) and not room.warnings and not room.no_shm


def _ctx(cfg: Config, hosts: tuple[str, ...], no_shm: dict[str, str]) -> factory.Context:
    return factory.Context(cfg, 0, len(hosts), hosts, Names("t", b"k"), 1, lambda: None,
                           no_shm=no_shm)


def test_every_rank_chooses_tcp_for_a_set_with_a_member_on_a_cramped_host():
    hosts = ("a", "a", "b", "b")
    cramped = {"b": "/dev/shm on host b has 1 bytes free"}
    ctx = _ctx(Config(), hosts, cramped)
    assert factory.choose(ctx, [0, 1]) == "shm"
    assert factory.choose(ctx, [2, 3]) == "tcp"
    assert factory.choose(ctx, [0, 1, 2, 3]) == "tcp"  # not hierarchical
    assert factory.choose(_ctx(Config(), hosts, {}), [0, 1, 2, 3]) == "hierarchical"
    with pytest.raises(ConfigError, match="RONDE_TRANSPORT=shm: /dev/shm on host b has 1 "
                                          "bytes free; enlarge it"):
        factory.choose(_ctx(Config(transport="shm"), hosts, cramped), [2, 3])
