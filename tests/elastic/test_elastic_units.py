"""The elastic pieces one at a time: assignment, blacklist, discovery, the exactly-once
shards, host-change agreement, the reset loop and the elastic rendezvous."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import numpy as np
import pytest

from ronde import (ConfigError, HorovodInternalError, HostsUpdatedInterrupt, PeerLostError,
                   TensorMismatchError)
from ronde.elastic import ObjectState, notify
from ronde.elastic.loop import resettable, run_fn
from ronde.elastic.sampler import ElasticShards
from ronde.runner.elastic_driver import Blacklist, Discovery, assign
from ronde.runner.hosts import places
from ronde.runner.elastic_rendezvous import ElasticRendezvous
from ronde.runner.hosts import HostSpec
from ronde.runner.rendezvous import exchange, query

pytestmark = pytest.mark.timeout(60)


def test_assignment_keeps_survivors_first_so_rank_0_is_one():
    hosts = [HostSpec("a", 2), HostSpec("b", 2), HostSpec("c", 1)]
    # b's survivors came first before: they stay first, in their old order
    got = assign(hosts, survivors=[("b", 1), ("b", 0)], max_np=None)
    assert got == [("b", 1), ("b", 0), ("a", 0), ("a", 1), ("c", 0)]
    assert assign(hosts, [("b", 1)], max_np=3) == [("b", 1), ("b", 0), ("a", 0)]
    # a slot left out (its worker failed) is not dealt again; a lost host's survivor goes
    assert assign(hosts, [("z", 0), ("a", 1)], None, {("a", 0)}) == \
        [("a", 1), ("b", 0), ("b", 1), ("c", 0)]
    layout = places(["b", "a", "b"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank) for s in layout] == \
        [(0, 0, 2, 0), (1, 0, 1, 1), (2, 1, 2, 0)]


def test_blacklist_for_good_or_for_a_cooldown():
    forever = Blacklist()
    forever.add("a")
    assert forever.blocked("a") and not forever.blocked("b")
    brief = Blacklist((0.05, 0.1))
    brief.add("a")
    assert brief.blocked("a")
    time.sleep(0.15)
    assert not brief.blocked("a")


def test_discovery_script_lines(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho '# a comment'\necho a:4\necho b\necho\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    assert Discovery(script=str(script), slots_per_host=2).find() == [HostSpec("a", 4),
                                                                      HostSpec("b", 2)]
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    bad.chmod(bad.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(Exception, match="exited with 3: broken"):
        Discovery(script=str(bad)).find()


def test_a_bad_line_of_discovery_output_is_skipped_not_fatal(tmp_path):
    """One non-UTF-8 byte used to raise UnicodeDecodeError in the launcher (issue #32)."""
    script = tmp_path / "hosts.sh"
    script.write_bytes(b"#!/bin/sh\nprintf 'a:2\\nb\\xff:3\\ntwo words:1\\nd:1\\n'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    d = Discovery(script=str(script))
    try:
        assert d.find() == [HostSpec("a", 2), HostSpec("d", 1)]
    finally:
        d.close()


def test_a_hanging_discovery_script_never_holds_the_driver(tmp_path):
    """The script runs off the driver's loop: ``find`` answers from the newest run at
    once while a run hangs; the hung run's whole process group is killed at its
    timeout and reported once; the last good host list stays."""
    flag, child = tmp_path / "hang", tmp_path / "child.pid"
    script = tmp_path / "hosts.sh"
    script.write_text(f"#!/bin/sh\necho a:2\nif [ -e {flag} ]; then sleep 300 & echo $! > {child}; "
                      "wait; fi\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    d = Discovery(script=str(script), timeout_s=1.0)
    try:
        assert d.find() == [HostSpec("a", 2)]
        flag.touch()
        errors, deadline = [], time.monotonic() + 20
        while not errors and time.monotonic() < deadline:
            try:
                assert d.find() == [HostSpec("a", 2)]
            except Exception as exc:  # noqa: BLE001 - the run that timed out
                errors.append(str(exc))
            time.sleep(0.05)
        assert errors and "did not finish within 1s; killed it and its children" in errors[0]
        pid = int(child.read_text())
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split(") ")[-1][:1] == "Z"
    finally:
        d.close()


def _script(tmp_path, name, body):
    script = tmp_path / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_discovery_takes_only_host_names_and_addresses(tmp_path, caplog):
    """Issue #50: a garbage line was taken as a host (and a 1 MiB one crashed the
    launcher later, resolving it)."""
    lines = ["a:2", "garbage!!", "a..b", "-rf", "1.2.3.999", "x" * 300, "Usage: ronde",
             "$(reboot)", "[::1]:3", "10.0.0.7", "svc_1.cluster.local:4", "fe80::1%eth0",
             "d:1  # a comment"]
    script = _script(tmp_path, "hosts.sh", "".join(f"echo '{line}'\n" for line in lines))
    d = Discovery(script=script, slots_per_host=2)
    try:
        assert d.find() == [HostSpec("a", 2), HostSpec("::1", 3), HostSpec("10.0.0.7", 2),
                            HostSpec("svc_1.cluster.local", 4), HostSpec("fe80::1%eth0", 2),
                            HostSpec("d", 1)]
    finally:
        d.close()
    skipped = [r.getMessage() for r in caplog.records if "skipping line" in r.getMessage()]
    assert [m.split(" of the output")[0] for m in skipped] == \
        [f"elastic: skipping line {n}" for n in (2, 3, 4, 5, 6, 7, 8)], skipped
    assert "is not a valid host name" in skipped[0]


def test_discovery_output_is_bounded_and_its_script_killed(tmp_path):
    """Issue #50: a 1 MiB line crashed the launcher, 200 MB of output ended the job as
    "no answer"; now the run fails at once with the limit, its script killed."""
    long_line = _script(tmp_path, "long.sh", "head -c 1048576 /dev/zero | tr '\\0' a; "
                        "echo; echo b\n")
    endless = _script(tmp_path, "endless.sh", "echo a:1; yes b\n")
    for script, message in ((long_line, "line 1 of its output is longer than 4096 bytes"),
                            (endless, "printed more than 1048576 bytes")):
        d = Discovery(script=script, timeout_s=60)
        try:
            with pytest.raises(ConfigError, match=message):
                d.find()
        finally:
            d.close()


def test_a_hung_discovery_script_is_killed_and_reaped_when_the_job_ends(tmp_path):
    """Issue #50: a hung script outlived the job (its run's timeout is 30 s; the job
    ended first)."""
    child, started = tmp_path / "child.pid", tmp_path / "script.pid"
    script = _script(tmp_path, "hang.sh", f"echo $$ > {started}; sleep 300 & "
                     f"echo $! > {child}; wait\n")
    d = Discovery(script=script, timeout_s=300)
    errors = []
    finder = threading.Thread(target=lambda: errors.append(_error_of(d.find)))
    finder.start()
    deadline = time.monotonic() + 20
    while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = [int(started.read_text()), int(child.read_text())]
    d.close()  # what run_elastic does at the job's end
    finder.join(timeout=20)
    assert errors and "the job ended" in errors[0], errors
    for pid in pids:  # the script reaped (no zombie: its parent waited), its child killed
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split(") ")[-1][:1] == "Z" and pid != pids[0]


def _error_of(call):
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def _simulate(shards_by_rank, batch, steps, commit_every, first=0):
    """Every rank takes batches ``first..first+steps-1``, recording; commits every few;
    returns what was processed."""
    processed = []
    for step in range(first, first + steps):
        for sh in shards_by_rank:
            b = sh.batches(batch)
            if step < len(b):
                sh.record_indices(b[step])
                processed.extend(b[step])
        if (step - first + 1) % commit_every == 0:
            _gather(shards_by_rank)
    return processed


def _gather(shards_by_rank):
    recorded = [np.concatenate(sh._recorded) if sh._recorded else np.zeros(0, np.int64)
                for sh in shards_by_rank]
    for sh in shards_by_rank:
        sh._recorded.clear()
        for part in recorded:
            sh.processed[part] = True


def _deal(shards, size):
    out = []
    for rank in range(size):
        sh = ElasticShards(shards.length, shards.shuffle, shards.seed)
        sh.load_state_dict(shards.state_dict())
        sh.rank, sh.size = rank, size
        sh.reset()
        out.append(sh)
    return out


@pytest.mark.parametrize("n,sizes", [(61, [3, 2, 4]), (10, [4, 3]), (7, [2, 5, 1])])
def test_shards_cover_an_epoch_exactly_once_across_resets(n, sizes):
    # horovod#3399/#3143: a re-formed job must neither repeat nor skip samples; what was
    # processed since the last commit is done again (rolled back), nothing else
    base = ElasticShards(n, shuffle=True, seed=5)
    done: list[int] = []
    for size in sizes[:-1]:
        ranks = _deal(base, size)
        _simulate(ranks, batch=2, steps=2, commit_every=2)  # one commit, then a failure
        uncommitted = _simulate(ranks, batch=2, steps=1, commit_every=99, first=2)
        base = ranks[0]
        base.drop_records()  # the restore: the last step is lost
        assert not set(uncommitted) & set(np.flatnonzero(base.processed))
    ranks = _deal(base, sizes[-1])
    steps = len(ranks[0].batches(2))
    assert all(len(r.batches(2)) == steps for r in ranks)  # the same steps everywhere
    _simulate(ranks, batch=2, steps=steps, commit_every=1)
    assert ranks[0].processed.all()
    for r in ranks:
        done.extend(i for b in r.batches(2) for i in b)
    assert len(done) == len(set(done))


def test_shards_start_a_new_epoch_in_a_new_order():
    sh = ElasticShards(20, shuffle=True, seed=1)
    first = list(sh)
    sh.set_epoch(1)
    assert sorted(list(sh)) == list(range(20)) and list(sh) != first
    assert ElasticShards(20, shuffle=False).indices.tolist() == list(range(20))
    with pytest.raises(IndexError):
        sh.record_indices([20])


def test_host_changes_are_decided_by_rank_0_for_everyone(monkeypatch):
    # a rank that joined after the last notice has an older view of its own; every rank
    # must still raise at the same commit, and only once per notice
    sent = []

    def bcast_from_rank0(obj):
        sent.append(obj)
        return rank0_view[0] if rank0_view else obj

    rank0_view = []
    monkeypatch.setattr(notify, "latest", lambda: (10.0, notify.ADDED))
    monkeypatch.setattr(notify, "baseline", lambda: 0.0)
    s = ObjectState(bcast_object=bcast_from_rank0, get_rank=lambda: 0, epoch=0)
    with pytest.raises(HostsUpdatedInterrupt) as info:
        s.commit()
    assert not info.value.skip_sync
    s.commit()  # seen: no second interrupt
    newcomer = ObjectState(bcast_object=bcast_from_rank0, get_rank=lambda: 1, epoch=0)
    rank0_view.append((10.0, 10.0, 0))  # rank 0 has seen notice 10 already
    newcomer.commit()  # so the newcomer does not raise either
    monkeypatch.setattr(notify, "baseline", lambda: 20.0)  # formed after a later notice
    monkeypatch.setattr(notify, "latest", lambda: (20.0, notify.REMOVED))
    rank0_view.clear()
    s.commit()


def test_object_state_commit_restore_sync():
    s = ObjectState(bcast_object=lambda o: {"epoch": 7, "seen": [1]}, get_rank=lambda: 1,
                    epoch=1, seen=[])
    s.seen.append(5)
    s.save()
    s.seen.append(6)
    s.epoch = 2
    s.restore()
    assert (s.epoch, s.seen) == (1, [5])
    s.sync()
    assert (s.epoch, s.seen) == (7, [1])


def test_which_errors_reset_the_job():
    assert resettable(PeerLostError("gone", rank=1))
    assert resettable(HorovodInternalError("ask for a reset"))
    assert not resettable(TensorMismatchError("a bug"))


def test_a_lost_peer_inside_a_jax_host_callback_still_resets_the_job():
    # JAX turns an exception raised in a host callback (Keras' fit on the JAX backend
    # runs ronde's collectives there) into a ValueError whose text is the traceback,
    # neither chained nor typed: the elastic loop did not reset on it and the job ended
    from ronde.elastic.loop import as_ronde_error

    wrapped = ValueError("INTERNAL: CpuCallback error calling callback: Traceback (most "
                         "recent call last):\n ... \nPeerLostError: rank 1 (host b) exited")
    found = as_ronde_error(wrapped)
    assert isinstance(found, PeerLostError) and resettable(found)
    assert as_ronde_error(ValueError("INTERNAL: CpuCallback error: TensorMismatchError")) is None
    assert as_ronde_error(ValueError("PeerLostError in a user's own message")) is None
    # the exception raised is the traceback's last: a lost peer met while handling, then
    # a mismatch raised, is the mismatch (a bug no reset cures)
    assert as_ronde_error(ValueError(
        "INTERNAL: CpuCallback error calling callback: Traceback (most recent call "
        "last):\nronde._errors.PeerLostError: rank 1 exited\n\nDuring handling of the "
        "above exception, another exception occurred:\n\nTraceback (most recent call "
        "last):\n  File \"x.py\", line 1\n    raise PeerLostError()\n"
        "ronde._errors.TensorMismatchError: 'w' differs")) is None
    # older jaxlib's text: the exception behind the callback error on one line
    found = as_ronde_error(ValueError("INTERNAL: Generated function failed: CpuCallback "
                                      "error: PeerLostError: rank 1 exited\n\nAt:\n  "
                                      "f.py(12): f"))
    assert isinstance(found, PeerLostError)
    # TensorFlow's text: the op's node behind the traceback
    found = as_ronde_error(_TfLike("{{function_node __wrapped__EagerPyFunc}} PeerLostError: "
                                   "rank 1 lost\nTraceback (most recent call last):\n"
                                   "ronde._errors.PeerLostError: rank 1 lost\n\n\t "
                                   "[[{{node EagerPyFunc}}]]"))
    assert isinstance(found, PeerLostError)


class _TfLike(Exception):
    """Stands for a TensorFlow op error (matched by its module)."""


_TfLike.__module__ = "tensorflow.python.framework.errors_impl"


def test_the_loop_restores_resets_and_retries(monkeypatch):
    import ronde.elastic.loop as loop

    monkeypatch.setattr(loop, "_agree_on_sync", lambda mine: mine)
    monkeypatch.setattr("ronde._api.rank", lambda: 0)
    calls = []

    class St(ObjectState):
        def sync(self):
            calls.append("sync")

        def restore(self):
            calls.append("restore")

        def on_reset(self):
            calls.append("on_reset")

    tries = iter([PeerLostError("lost", rank=1), HostsUpdatedInterrupt(True), None])

    def train(state):
        calls.append("train")
        exc = next(tries)
        if exc is not None:
            raise exc
        return "ok"

    wrapped = run_fn(train, reset=lambda: calls.append("reset"))
    assert wrapped(St(bcast_object=lambda o: o, get_rank=lambda: 0)) == "ok"
    assert calls == ["sync", "train", "restore", "reset", "on_reset", "sync", "train",
                     "reset", "on_reset", "train"]  # removed-only: no sync after it
    with pytest.raises(TensorMismatchError):
        run_fn(lambda s: (_ for _ in ()).throw(TensorMismatchError("bug")),
               reset=lambda: None)(St(bcast_object=lambda o: o, get_rank=lambda: 0))
    # an exception of the user's own propagates as it is (no reset, no exit 0)
    with pytest.raises(KeyError, match="users"):
        run_fn(lambda s: {}["users"], reset=lambda: None)(
            St(bcast_object=lambda o: o, get_rank=lambda: 0))


def test_elastic_rendezvous_forms_generations_and_removes_slots():
    secret = b"k" * 32
    server = ElasticRendezvous(secret).start()
    try:
        got = {}

        def reg(host, slot):
            got[(host, slot)] = exchange(server.address, secret,
                                         {"elastic": True, "host": host, "slot": slot,
                                          "addr": "127.0.0.1", "port": 1}, 10.0)

        server.set_assignment([("b", 0), ("a", 0)])
        threads = [threading.Thread(target=reg, args=s) for s in (("a", 0), ("b", 0))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert got[("b", 0)]["rank"] == 0 and got[("a", 0)]["rank"] == 1
        assert got[("a", 0)]["size"] == 2 and got[("a", 0)]["generation"] == 1
        server.announce(notify.ADDED)
        assert query(server.address, secret, {"what": "hosts"})["update"] == notify.ADDED
        # a: removed; b alone forms the next generation
        server.set_assignment([("b", 0)], removed=[("a", 0)])
        reg("a", 0)
        assert got[("a", 0)]["kind"] == "removed"
        reg("b", 0)
        assert got[("b", 0)]["size"] == 1 and got[("b", 0)]["generation"] == 2
        # b comes back by itself (a reset the driver did not ask for): re-formed alone
        reg("b", 0)
        assert got[("b", 0)]["generation"] == 3
    finally:
        server.close()


def test_a_plain_registration_is_refused_by_an_elastic_job():
    secret = b"k" * 32
    server = ElasticRendezvous(secret).start()
    try:
        from ronde import RendezvousError

        with pytest.raises(RendezvousError, match="elastic job"):
            exchange(server.address, secret, {"rank": 0, "size": 1, "generation": 1}, 5.0)
    finally:
        server.close()
    assert socket  # noqa: the module is used by the server under test


def test_each_slice_of_a_sharded_optimizer_has_a_holder_after_a_reset_or_a_clear_error():
    from ronde import RondeError
    from ronde.frameworks.reshard import holders as _holders

    # committed at 4 ranks; old rank 2 died; the survivors are now ranks 0-2, a new
    # worker is rank 3 (committed nothing): 2's slice is at old rank 1 (its neighbour)
    was = [(0, 4), (1, 4), (3, 4), (-1, 0)]
    assert _holders(was, 4) == {0: (0, True), 1: (1, True), 2: (1, False), 3: (2, True)}
    # old rank 0's copy is kept by the last rank (ranks wrap around)
    assert _holders([(1, 3), (2, 3)], 3) == {0: (1, False), 1: (0, True), 2: (1, True)}
    # two neighbours lost together: nothing holds old rank 2's slice
    with pytest.raises(RondeError, match=r"rank\(s\) \[2\] of the last commit \(at 4 ranks\)"):
        _holders([(0, 4), (3, 4)], 4)
    # at one rank there is no copy
    with pytest.raises(RondeError, match="load_sharded"):
        _holders([(-1, 0)], 1)
