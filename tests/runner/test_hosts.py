"""Host parsing, slot assignment and their errors (no processes)."""

from __future__ import annotations

import re
import socket

import pytest

from ronde._errors import ConfigError
from ronde.runner.hosts import (MAX_RANKS, MAX_SLOTS_PER_HOST, HostSpec, assign_ranks, is_local,
                                layout, parse_hostfile, parse_hostfile_lines, parse_hosts)

pytestmark = pytest.mark.timeout(10)


def test_parse_hosts_slots_and_defaults() -> None:
    assert parse_hosts("a:2,b:3,c") == [HostSpec("a", 2), HostSpec("b", 3), HostSpec("c", 1)]
    assert parse_hosts(" a:1 , 10.0.0.2:4 ") == [HostSpec("a", 1), HostSpec("10.0.0.2", 4)]
    assert parse_hosts("[::1]:2,[fe80::1]") == [HostSpec("::1", 2), HostSpec("fe80::1", 1)]


@pytest.mark.parametrize("text, match", [
    ("a:0", "at least 1 slot"),
    ("a:-1", "at least 1 slot"),
    ("a:x", "'x' is not an integer"),
    ("a,,b", "empty host entry"),
    ("", "-H/--hosts is empty"),
    ("a:1,a:2", "listed twice"),
    ("a b:2", "not a valid host name"),
    ("[::1", "unclosed"),
])
def test_parse_hosts_errors(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_hosts(text)


def test_hostfile_formats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "hosts"
    f.write_text("# cluster\n\nnode1 slots=4\nnode2:2   # comment\nnode3\n  \n")
    assert parse_hostfile(f) == [HostSpec("node1", 4), HostSpec("node2", 2),
                                 HostSpec("node3", 1)]


@pytest.mark.parametrize("lines, match", [
    (["n1 slots=0"], r"hf:1: a host needs at least 1 slot"),
    (["n1", "n2 cores=2"], r"hf:2: cannot parse 'n2 cores=2'"),
    (["n1:2 slots=2"], "give the slots once"),
    (["# only comments", ""], "no hosts found"),
    (["n1 slots=2 extra"], "cannot parse"),
])
def test_hostfile_errors(lines: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_hostfile_lines(lines, "hf")


def test_hostfile_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "nope")


def test_assign_fills_hosts_in_order() -> None:
    slots = assign_ranks(parse_hosts("a:2,b:2,c:2"), 5)
    assert [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots] == [
        (0, "a", 0, 2, 0, 3), (1, "a", 1, 2, 0, 3),
        (2, "b", 0, 2, 1, 3), (3, "b", 1, 2, 1, 3),
        (4, "c", 0, 1, 2, 3),
    ]


def test_assign_leaves_unused_hosts_out() -> None:
    slots = assign_ranks(parse_hosts("a:4,b:4"), 3)
    assert {s.host for s in slots} == {"a"}
    assert all(s.cross_size == 1 and s.local_size == 3 for s in slots)


def test_np_larger_than_slots() -> None:
    with pytest.raises(ConfigError, match=r"-np 5 but the hosts give only 4 slots: a:2, b:2"):
        assign_ranks(parse_hosts("a:2,b:2"), 5)
    with pytest.raises(ConfigError, match="-np must be at least 1"):
        assign_ranks(parse_hosts("a:2"), 0)


def test_layout_defaults() -> None:
    assert len(layout(None, "a:2,b:3")) == 5
    local = layout(3)
    assert [s.host for s in local] == ["localhost"] * 3
    assert [s.local_rank for s in local] == [0, 1, 2]
    with pytest.raises(ConfigError, match="-np is required"):
        layout(None)
    with pytest.raises(ConfigError, match="not both"):
        layout(2, "a:2", "somefile")


def test_is_local() -> None:
    for name in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", socket.gethostname()):
        assert is_local(name), name
    for name in ("fakehost1", "192.0.2.77", "example.invalid"):
        assert not is_local(name), name


def test_slot_limits_are_generous() -> None:
    assert (MAX_SLOTS_PER_HOST, MAX_RANKS) == (4096, 65536)  # docs/launcher.md says so
    assert parse_hosts("a:4096") == [HostSpec("a", 4096)]
    assert len(layout(None, ",".join(f"h{i}:4096" for i in range(16)))) == MAX_RANKS


def test_a_hostfile_slot_count_over_the_limit_is_refused_at_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "hosts"
    f.write_text("localhost slots=99999999999\n")
    # was: no error, and the launcher grew by 1 GB per 10 s building rank records
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}:1: host 'localhost' has "
                                          "99999999999 slots, more than the 4096 ranks ronderun "
                                          "starts on one host$"):
        layout(None, hostfile=f)


@pytest.mark.parametrize("np, hosts, match", [
    (None, "node1:4097", r"^-H node1:4097: host 'node1' has 4097 slots, more than the 4096"),
    (None, "[::1]:5000", r"^-H \[::1\]:5000: host '::1' has 5000 slots, more than the 4096"),
    (99999999999, None, r"^-np 99999999999 on localhost: more than the 4096 ranks ronderun "
                        "starts on one host; give hosts with -H/--hostfile$"),
    (99999999999, "a:2", r"^-np 99999999999: ronderun starts at most 65536 ranks$"),
    (None, ",".join(f"h{i}:4096" for i in range(17)),
     r"^the hosts give 69632 slots, more than the 65536 ranks ronderun starts in one job; "
     "give -np$"),
])
def test_absurd_slot_counts_and_np_are_refused(np, hosts, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        layout(np, hosts)


def test_a_hostfile_byte_that_is_not_utf8_names_the_file_and_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "hosts"
    f.write_bytes(b"node1 slots=2\nnode\xff slots=2\n")
    # was: UnicodeDecodeError traceback
    with pytest.raises(ConfigError,
                       match=rf"^{re.escape(str(f))}:2: byte 0xff at column 5 is not UTF-8 text"):
        parse_hostfile(f)
    f.write_bytes(b"# caf\xe9's nodes (latin-1)\nnode1 slots=2  # \xff\n")
    assert parse_hostfile(f) == [HostSpec("node1", 2)]  # comments may hold any bytes
