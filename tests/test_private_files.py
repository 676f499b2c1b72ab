"""The private directory and the checked open (``_private_files.py``): what another user
of the host could have put in ronde's way is refused, naming the path and the fix."""

from __future__ import annotations

import os
import stat
import tempfile
import threading

import pytest

from ronde import SecurityError
from ronde import _private_files as pf

#: another user's uid (``nobody``); giving a file to it needs root
OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to "
                             "another user (chown to uid 65534); CI runs as root")


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A world-writable sticky folder standing for /tmp, as TMPDIR; no XDG_RUNTIME_DIR."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return shared


def test_the_private_directory_is_made_0700_whatever_the_umask(shared_tmp):
    old = os.umask(0o022)
    try:
        path = pf.private_dir()
    finally:
        os.umask(old)
    assert path == str(shared_tmp / f"ronde-{os.getuid()}")
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()
    assert pf.private_dir() == path  # and found again
    old = os.umask(0o277)  # a umask that takes the owner's bits: restored to 0700
    try:
        os.rmdir(path)
        assert stat.S_IMODE(os.lstat(pf.private_dir()).st_mode) == 0o700
    finally:
        os.umask(old)


def test_xdg_runtime_dir_is_used_only_where_it_is_this_users_0700_directory(
        shared_tmp, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    run.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    assert pf.private_dir() == str(run / "ronde")
    run.chmod(0o755)  # not private: the temporary directory instead
    assert pf.private_dir() == str(shared_tmp / f"ronde-{os.getuid()}")


@as_root
def test_a_private_directory_of_another_user_is_refused(shared_tmp):
    path = shared_tmp / f"ronde-{os.getuid()}"
    path.mkdir(mode=0o700)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(SecurityError, match=rf"ronde's private directory {path} is owned by "
                       rf"uid {OTHER_UID}, not by this user .*remove it .*XDG_RUNTIME_DIR"):
        pf.private_dir()


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o701])
def test_a_private_directory_others_may_enter_is_refused(shared_tmp, mode):
    path = shared_tmp / f"ronde-{os.getuid()}"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(SecurityError, match=rf"{path} has mode 0{mode:o}, not 0700.*TMPDIR"):
        pf.private_dir()


def test_a_link_or_a_file_at_the_private_directorys_name_is_refused(shared_tmp, tmp_path):
    path = shared_tmp / f"ronde-{os.getuid()}"
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    path.symlink_to(target)
    with pytest.raises(SecurityError, match=rf"{path} is a symbolic link, not a directory"):
        pf.private_dir()
    path.unlink()
    path.write_text("")
    with pytest.raises(SecurityError, match=rf"{path} is not a directory"):
        pf.private_dir()


def test_create_file_makes_a_new_0600_file_under_a_random_name(tmp_path):
    fd, path = pf.create_file(str(tmp_path), ".x-", ".tmp")
    os.close(fd)
    fd2, path2 = pf.create_file(str(tmp_path), ".x-", ".tmp")
    os.close(fd2)
    assert path != path2 and os.path.basename(path).startswith(".x-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_open_checked_reads_this_users_own_file(tmp_path):
    fd, path = pf.create_file(str(tmp_path), "f-")
    os.write(fd, b"ok")
    os.close(fd)
    fd = pf.open_checked(path)
    try:
        assert os.read(fd, 10) == b"ok"
    finally:
        os.close(fd)
    with pytest.raises(FileNotFoundError):
        pf.open_checked(str(tmp_path / "absent"))


@as_root
def test_open_checked_refuses_another_users_file(tmp_path):
    path = tmp_path / "theirs"
    path.write_text('{"port": 1}')
    path.chmod(0o600)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(SecurityError, match=rf"{path} is owned by uid {OTHER_UID}, not by "
                       "this user.*does not trust it.*remove it"):
        pf.open_checked(str(path))


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o620])
def test_open_checked_refuses_a_file_others_may_read_or_write(tmp_path, mode):
    path = tmp_path / "open"
    path.write_text("{}")
    path.chmod(mode)
    with pytest.raises(SecurityError, match=rf"{path} has mode 0{mode:o}; ronde's files are "
                       "0600"):
        pf.open_checked(str(path))


def test_open_checked_refuses_a_link_even_to_this_users_file(tmp_path):
    fd, target = pf.create_file(str(tmp_path), "t-")
    os.close(fd)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(SecurityError, match=rf"{link} is a symbolic link"):
        pf.open_checked(str(link))


def test_open_checked_refuses_a_fifo_without_blocking_on_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    done: list[BaseException] = []

    def opener() -> None:
        try:
            pf.open_checked(str(fifo))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            done.append(exc)

    t = threading.Thread(target=opener, daemon=True)
    t.start()
    t.join(10)  # (a plain open() would block here until a writer came)
    assert done and isinstance(done[0], SecurityError), done
    assert f"{fifo} is not a regular file" in str(done[0])
