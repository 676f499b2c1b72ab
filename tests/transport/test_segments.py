"""Shared-memory segment files (transport/segments.py): names nobody without the job's
secret can tell, made new, checked before they are mapped, reserved up front."""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid

import pytest

from ronde import ConfigError, SecurityError
from ronde.transport import segments
from ronde.transport.segments import (Names, create_segment, open_segment,
                                      remove_job_segments, shm_dir)

OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to "
                             "another user (chown to uid 65534); CI runs as root")
TOTAL = 1 << 16


@pytest.fixture
def names():
    job = f"segtest{uuid.uuid4().hex[:8]}"
    yield Names(job, b"s" * 32)
    remove_job_segments(job)
    for f in os.listdir(shm_dir()):  # what the tests gave to another user
        if f.startswith(f"ronde-{job}-"):
            os.unlink(os.path.join(shm_dir(), f))


def test_names_are_unguessable_without_the_secret_and_unrelated_between_ranks():
    a, b = Names("torchrun-none-29500", b"a" * 32), Names("torchrun-none-29500", b"b" * 32)
    assert a.path("g1-ps0-0") == Names("torchrun-none-29500", b"a" * 32).path("g1-ps0-0")
    assert a.path("g1-ps0-0") != b.path("g1-ps0-0")
    p0, p1 = a.of("g1-ps0")(0), a.of("g1-ps0")(1)
    prefix = os.path.join(shm_dir(), "ronde-torchrun_none_29500-")
    assert p0.startswith(prefix) and p1.startswith(prefix)
    tag0, tag1 = p0[len(prefix):], p1[len(prefix):]
    assert len(tag0) == 32 and not set(tag0) - set("0123456789abcdef")
    # seeing rank 0's segment says nothing of rank 1's (no shared part beyond the prefix)
    assert sum(x == y for x, y in zip(tag0, tag1)) < 12
    # a job of one (no secret): a random key, a fresh name every time
    assert Names("j", b"").path("x") != Names("j", b"").path("x")


def test_a_segment_is_made_0600_and_reserved_in_full(names):
    path = names.path("mine")
    mm = create_segment(path, TOTAL)
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == TOTAL
        assert st.st_blocks * 512 >= TOTAL  # the memory is there: no SIGBUS later
        peer = open_segment(path, TOTAL, time.monotonic() + 1)
        peer.close()
    finally:
        mm.close()


@as_root
def test_another_users_file_at_a_segments_name_is_never_used(names):
    path = names.path("planted")
    with open(path, "wb") as fh:
        fh.write(b"attacker")
    os.chmod(path, 0o666)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(SecurityError, match=rf"shared-memory segment {path}: a file of uid "
                       rf"{OTHER_UID} is already there.*RONDE_TRANSPORT=tcp"):
        create_segment(path, TOTAL)
    with pytest.raises(SecurityError, match=rf"{path} is owned by uid {OTHER_UID}"):
        open_segment(path, TOTAL, time.monotonic() + 60)  # at once, not at the deadline
    with open(path, "rb") as fh:
        assert fh.read() == b"attacker"  # neither truncated nor written


def test_a_link_at_a_segments_name_is_never_followed(names, tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    path = names.path("link")
    os.symlink(target, path)
    with pytest.raises(SecurityError, match=rf"{path}: a symbolic link of uid"):
        create_segment(path, TOTAL)
    with pytest.raises(SecurityError, match=rf"{path} is a symbolic link"):
        open_segment(path, TOTAL, time.monotonic() + 60)
    assert target.read_bytes() == b"precious"


def test_a_peers_segment_open_to_others_is_not_mapped(names):
    path = names.path("open")
    create_segment(path, TOTAL).close()
    os.chmod(path, 0o666)
    with pytest.raises(SecurityError, match=rf"{path} has mode 0666; ronde's files are 0600"):
        open_segment(path, TOTAL, time.monotonic() + 60)


def test_this_users_own_leftover_is_replaced_not_reused(names):
    path = names.path("left")
    with open(path, "wb") as fh:  # a killed start-up of the same job id and secret
        fh.write(b"old bytes")
    before = os.stat(path).st_ino
    mm = create_segment(path, TOTAL)
    try:
        assert mm[:9] == b"\0" * 9 and os.stat(path).st_ino != before
    finally:
        mm.close()


def test_a_dev_shm_too_small_is_an_error_naming_it_and_the_remedy(names, monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segments.os, "posix_fallocate", full)
    path = names.path("big")
    with pytest.raises(ConfigError, match=rf"{shm_dir()} has no room for this rank's "
                       rf"shared-memory segment: {TOTAL} bytes needed, \d+ free.*"
                       r"RONDE_TRANSPORT=tcp.*RONDE_SHM_SEGMENT.*mount -o remount,size="):
        create_segment(path, TOTAL)
    assert not os.path.exists(path)  # nothing left behind


@as_root
def test_the_launchers_clean_up_removes_only_this_users_segments(names):
    mine, theirs = names.path("a"), names.path("b")
    create_segment(mine, TOTAL).close()
    with open(theirs, "wb"):
        pass
    os.chown(theirs, OTHER_UID, OTHER_UID)
    job = os.path.basename(mine)[len("ronde-"):].split("-")[0]
    assert remove_job_segments(job) == 1
    assert not os.path.exists(mine) and os.path.exists(theirs)
