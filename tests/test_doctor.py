"""``ronde doctor`` (and ``ronderun --check-build``): what this machine can use."""

from __future__ import annotations

import pytest

from ronde import cli
from ronde.transport import vm


def _shm_line(capsys) -> str:
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.strip().startswith("shm")]
    return line


@pytest.mark.parametrize("scope,want", [
    (None, "single-copy collectives: yes"),
    (1, "yes (Yama ptrace_scope 1: each rank allows its peers"),
    (2, "single-copy collectives: no, Yama ptrace_scope is 2"),
])
def test_doctor_says_whether_single_copy_collectives_work(monkeypatch, capsys, scope, want):
    monkeypatch.setattr(vm, "supported", lambda: True)
    monkeypatch.setattr(vm, "ptrace_scope", lambda: scope)
    assert want in _shm_line(capsys)


def test_doctor_says_when_the_system_calls_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(vm, "supported", lambda: False)
    assert "no, process_vm_readv is refused here" in _shm_line(capsys)


@pytest.mark.parametrize("active,thp,want", [
    (True, True, "huge pages for it: yes"),
    (False, False, "huge pages for it: no, transparent huge pages are off"),
    (False, True, "huge pages for it: no, the kernel lacks MADV_COLLAPSE"),
])
def test_doctor_says_whether_memory_peers_read_goes_onto_huge_pages(monkeypatch, capsys,
                                                                   active, thp, want):
    from ronde.transport import hugepages

    monkeypatch.setattr(vm, "supported", lambda: True)
    monkeypatch.setattr(vm, "ptrace_scope", lambda: None)
    monkeypatch.setattr(hugepages.HugePages, "active", property(lambda self: active))
    monkeypatch.setattr(hugepages, "thp_allowed", lambda *a: thp)
    assert want in _shm_line(capsys)
