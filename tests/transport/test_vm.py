"""Cross-memory attach permissions: Yama's ptrace scope, and what a rank does about it.

The machine running the suite may have no Yama at all (as here), so the scope file and
libc's ``prctl`` are replaced by fakes: what is tested is which call ronde makes for
which scope, and what it reports.
"""

from __future__ import annotations

import numpy as np
import pytest

from ronde.transport import vm


class _FakeLibc:
    def __init__(self, result: int = 0) -> None:
        self.calls: list[tuple] = []
        self.result = result
        outer = self

        class _Fn:
            restype = argtypes = None

            def __call__(self, *args):
                outer.calls.append(args)
                return outer.result

        self.prctl = _Fn()


@pytest.fixture
def scope(tmp_path, monkeypatch):
    path = tmp_path / "ptrace_scope"
    monkeypatch.setattr(vm, "_PTRACE_SCOPE", str(path))

    def set_scope(value: str | None) -> None:
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(value + "\n")

    return set_scope


@pytest.mark.parametrize("value,want", [(None, None), ("0", 0), ("1", 1), ("2", 2), ("x", None)])
def test_ptrace_scope_is_read_from_yama(scope, value, want):
    scope(value)
    assert vm.ptrace_scope() == want


def test_descendants_only_scope_is_lifted_for_this_process(scope, monkeypatch):
    scope("1")
    libc = _FakeLibc()
    monkeypatch.setattr(vm, "libc_handle", lambda: libc)
    assert vm.allow_peers()
    # PR_SET_PTRACER ("Yama" in ASCII), PR_SET_PTRACER_ANY, then three unused arguments
    assert libc.calls == [(0x59616D61, 2**64 - 1, 0, 0, 0)]


@pytest.mark.parametrize("value,allowed", [(None, True), ("0", True), ("2", False),
                                           ("3", False)])
def test_other_scopes_are_left_alone(scope, monkeypatch, value, allowed):
    scope(value)
    libc = _FakeLibc()
    monkeypatch.setattr(vm, "libc_handle", lambda: libc)
    assert vm.allow_peers() is allowed
    assert libc.calls == []


def test_a_refused_prctl_is_reported(scope, monkeypatch):
    scope("1")
    monkeypatch.setattr(vm, "libc_handle", lambda: _FakeLibc(result=-1))
    assert not vm.allow_peers()


def test_a_shared_memory_communicator_allows_its_peers_only_with_single_copy(monkeypatch):
    from ronde.transport.segments import Names
    from ronde.transport.shm import ShmCommunicator

    calls = []
    monkeypatch.setattr(vm, "allow_peers", lambda: calls.append(1) or True)
    for cma, want in ((True, [1]), (False, [])):
        calls.clear()
        comm = ShmCommunicator(0, [0], Names(f"vmtest{int(cma)}", b"").of("t"), 1 << 16,
                               lambda: None, cma=cma)
        try:
            assert calls == want
        finally:
            comm.close()


def test_address_matches_numpy_and_falls_back_for_read_only_arrays():
    a = np.arange(10, dtype=np.float32)[3:]
    assert vm.address(a) == a.ctypes.data
    ro = np.arange(4.0)
    ro.flags.writeable = False
    assert vm.address(ro) == ro.ctypes.data
    assert isinstance(vm.address(np.empty(0)), int)  # empty: no buffer to export
