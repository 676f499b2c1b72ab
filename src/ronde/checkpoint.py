"""Checkpoints that are whole or absent: ``save_checkpoint`` writes atomically on one rank.

The usual ``if hvd.rank() == 0: torch.save(state, path)`` truncates ``path`` first and
writes it over seconds: a crash in between (a peer's failure makes the launcher stop
every rank) left a torn file and no previous checkpoint. :func:`atomic_save` instead
writes to a temporary file in the same directory, flushes and ``fsync``s it, renames it
over ``path`` (atomic on POSIX) and ``fsync``s the directory, so ``path`` always holds
the previous checkpoint or the new one; on any failure the temporary is removed.

While a save runs on the main thread, a SIGTERM (the launcher stopping this rank
because a peer failed, or the launcher gone: runner/lifeline.py) waits until the file
is in place, then takes effect as it would have. ``ronderun`` gives a rank
``RONDE_STOP_GRACE`` seconds (default 10) between its SIGTERM and its SIGKILL; a rank
that is not saving dies at the SIGTERM, so the grace costs nothing there.

The bindings give it their own writer: ``ronde.torch.save_checkpoint`` (``torch.save``),
``ronde.keras.save_checkpoint`` (``model.save``), ``ronde.jax.save_checkpoint`` (a
pytree as numpy arrays); ``ronde.save_checkpoint`` pickles any object.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import tempfile
import threading
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .process_sets import ProcessSet

__all__ = ["atomic_save", "save_checkpoint", "deferred_termination"]


@contextlib.contextmanager
def deferred_termination() -> Iterator[None]:
    """Hold SIGTERM (and SIGINT) off while the block runs on the main thread; a signal
    that came meanwhile is delivered again at the end, to the handler that was in place.
    Elsewhere (another thread, no signals) the block runs unprotected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        caught.append(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            previous[sig] = signal.signal(sig, hold)
        except (ValueError, OSError):
            pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for sig in dict.fromkeys(caught):
            os.kill(os.getpid(), sig)


def atomic_save(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None] | None = None,
                *, write_path: Callable[[str], None] | None = None) -> str:
    """Write ``path`` atomically; returns it.

    Args:
        path: the checkpoint's final path.
        write: writes the checkpoint to an open binary file (``torch.save(obj, fh)``).
        write_path: instead, writes the checkpoint to a path (a writer that opens the
            file itself, such as Keras' ``model.save``); the temporary path keeps
            ``path``'s extension.
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    # the whole extension (Keras wants ".weights.h5", not ".h5")
    ext = "." + name.lstrip(".").split(".", 1)[1] if "." in name.lstrip(".") else ""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=f".tmp{ext}")
    try:
        with deferred_termination():
            if write_path is not None:
                os.close(fd)
                fd = -1
                write_path(tmp)
                fd = os.open(tmp, os.O_RDONLY)
                os.fsync(fd)
            else:
                assert write is not None, "atomic_save needs write or write_path"
                with os.fdopen(fd, "wb") as fh:
                    fd = -1
                    write(fh)
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
            _fsync_dir(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return path


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(obj: Any, path: str | os.PathLike[str], root_rank: int = 0) -> bool:
    """Pickle ``obj`` to ``path`` atomically on ``root_rank`` (no collective: call it on
    every rank, or only under ``if hvd.rank() == 0``); True where it wrote."""
    if not on_root(root_rank):
        return False
    atomic_save(path, lambda fh: pickle.dump(obj, fh, protocol=pickle.HIGHEST_PROTOCOL))
    return True


def on_root(root_rank: int) -> bool:
    """True on ``root_rank`` (and in a process that never called ``init()``)."""
    from ._api import is_initialized, rank

    return not is_initialized() or rank() == root_rank


def commit_sharded_save(directory: str, meta_name: str, write_meta: Callable[[IO[bytes]], None],
                        token: str, ext: str) -> None:
    """The last step of a sharded save (``save_sharded`` of every binding): write the
    index ``meta_name`` atomically, after every rank's ``optim.<token>.*<ext>`` file is
    complete, then remove the previous save's files (another token). A save cut short
    before this leaves the previous checkpoint whole."""
    atomic_save(os.path.join(directory, meta_name), write_meta)
    for f in os.listdir(directory):
        if f.startswith("optim.") and f.endswith(ext) and f".{token}." not in f:
            os.remove(os.path.join(directory, f))


def sharded_meta(directory: str | os.PathLike[str], meta_name: str) -> tuple[str, str]:
    """``(directory, its index file)`` of a sharded save, or ``FileNotFoundError`` when
    the index is missing (not such a folder, or a save that did not complete)."""
    directory = os.fspath(directory)
    meta_path = os.path.join(directory, meta_name)
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} is missing: not a save_sharded() folder, or the "
                                "save did not complete")
    return directory, meta_path


def begin_sharded_save(directory: str, many: bool, process_set: "ProcessSet"
                       ) -> tuple[str, bool, bool]:
    """The first step of a sharded save (``save_sharded`` of every binding): make the
    folder; returns ``(token, writer, together)``: the save's id (rank 0's, when ``many``
    ranks each write a slice), whether this rank writes a file (every rank of a sharded
    state; only rank 0 of an unsharded one) and whether the job has several ranks."""
    import secrets

    from . import _api, _objects

    together = _api.is_initialized() and _api.size() > 1
    writer = many or not together or _api.rank() == 0
    token = secrets.token_hex(6)
    if many:
        ranks = process_set.ranks
        token = _objects.broadcast_object(token, ranks[0] if ranks else 0,
                                          "ronde.save_sharded.id", process_set)
    os.makedirs(directory, exist_ok=True)
    return token, writer, together
