"""How the ranks of a host count its cores (the union of their CPU affinities, from the
rendezvous table: every rank there decides alike whether the host is oversubscribed),
and what that decides: shared-memory mailboxes only while ranks <= cores."""

from __future__ import annotations

from ronde import _config, _cores, _runtime


def _peers(*entries):
    return [{"host": h, "cpus": c} for h, c in entries]


def test_the_ranks_of_a_host_count_the_union_of_their_cpus():
    peers = _peers(("a", [0]), ("a", [1]), ("b", [0, 1, 2, 3]), ("a", [0, 1]))
    assert _cores.host_cores(peers, 0) == 2  # ranks bound to one core each still add up
    assert _cores.host_cores(peers, 2) == 4


def test_a_malformed_cpu_list_counts_as_unknown():
    for bad in (None, "0-3", [-1], [1.5], list(range(70000)), []):
        assert _cores.host_cores(_peers(("a", [0]), ("a", bad)), 0) == 0


def test_mailboxes_only_on_hosts_with_a_core_per_rank_decided_alike_everywhere():
    cfg = _config.Config()
    topo = _runtime.Topology.build(0, ["a"] * 4 + ["b"] * 2 + ["c"])
    cores = (2,) * 4 + (8,) * 2 + (8,)
    # a: 4 ranks on 2 cores, sockets; b: 2 ranks on 8 cores, mailboxes; c: one rank
    assert _cores.mailbox_hosts(cfg, topo, cores) == {"b"}
    assert _cores.control_mailboxes(cfg, topo, 0, 7, "k", cores) is None
    assert _cores.mailbox_hosts(_config.Config(shm_control="on"), topo, cores) == {"a", "b"}
    assert _cores.mailbox_hosts(_config.Config(shm_control="off"), topo, cores) == set()


def test_the_coordinator_where_the_job_spans_hosts_or_no_host_uses_mailboxes():
    cfg = _config.Config()  # coordinator from 3 ranks
    one_host = _runtime.Topology.build(0, ["a"] * 4)
    assert not _cores.coordinated(cfg, one_host, (8,) * 4)  # mailboxes: all-to-all
    assert _cores.coordinated(cfg, one_host, (2,) * 4)      # oversubscribed: sockets
    hosts = _runtime.Topology.build(0, ["a", "a", "b", "b"])
    assert _cores.coordinated(cfg, hosts, (8,) * 4)         # several hosts: rank 0
    assert _cores.control_mailboxes(cfg, hosts, 0, 4, "k", (8,) * 4) is None
    two = _runtime.Topology.build(0, ["a", "b"])
    assert not _cores.coordinated(cfg, two, (8, 8))         # 2 ranks: one hop
    assert not _cores.coordinated(_config.Config(coordinator_min=0), hosts, (8,) * 4)


def test_ranks_of_an_oversubscribed_host_do_not_spin_and_hold_longer_unless_told_to():
    cfg = _config.Config()  # RONDE_SPIN_TIME 200 us, RONDE_ROUND_HOLD 50 ms by default
    hosts = ["a"] * 5 + ["b"] * 2
    cores = (2,) * 5 + (8,) * 2
    a, b = _runtime.Topology.build(0, hosts), _runtime.Topology.build(5, hosts)
    got = _cores.for_this_host(cfg, a, cores, set())  # 5 ranks on 2 cores: 3 a core
    assert (got.spin_time_us, got.round_hold_ms) == (0.0, 150.0)
    assert _cores.for_this_host(cfg, b, cores, set()) is cfg  # a core each
    got = _cores.for_this_host(cfg, a, cores, {"spin_time_us", "round_hold_ms"})
    assert (got.spin_time_us, got.round_hold_ms) == (200.0, 50.0)  # set: kept
    got = _cores.for_this_host(_config.Config(round_hold_ms=0.0), a, cores, {"round_hold_ms"})
    assert (got.spin_time_us, got.round_hold_ms) == (0.0, 0.0)


def test_no_small_first_bucket_on_one_host_whose_ranks_have_no_core_to_spare():
    cfg = _config.Config()
    one = _runtime.Topology.build(1, ["a"] * 2)
    assert _cores.first_bucket(cfg, one, (2, 2)) == cfg.bucket_bytes  # ranks == cores
    assert _cores.first_bucket(cfg, one, (3, 3)) == _cores.FIRST_BUCKET_BYTES  # one spare
    two_hosts = _runtime.Topology.build(0, ["a", "b"])  # the network: overlap pays
    assert _cores.first_bucket(cfg, two_hosts, (1, 1)) == _cores.FIRST_BUCKET_BYTES
    assert _cores.first_bucket(cfg, _runtime.Topology.build(0, ["a"]), (1,)) == \
        _cores.FIRST_BUCKET_BYTES  # one rank: nothing to reduce
    # set, it is what it says; read from the environment, `auto` or a size
    assert _cores.first_bucket(_config.Config(first_bucket_bytes=4096), one, (2, 2)) == 4096
    assert _config.load({"RONDE_FIRST_BUCKET_BYTES": "auto"}).first_bucket_bytes is None
    assert _config.load({"RONDE_FIRST_BUCKET_BYTES": "2MB"}).first_bucket_bytes == 2 << 20
    import pytest

    with pytest.raises(_config.ConfigError, match="RONDE_FIRST_BUCKET_BYTES"):
        _config.load({"RONDE_FIRST_BUCKET_BYTES": "65GiB"})
