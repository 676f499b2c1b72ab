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
import errno
import json
import logging
import os
import pickle
import secrets
import signal
import stat
import threading
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .process_sets import ProcessSet

__all__ = ["atomic_save", "save_checkpoint", "deferred_termination"]

log = logging.getLogger(__name__)


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
    """Write ``path`` atomically; returns it. The file's mode follows the umask, as
    ``torch.save(obj, path)``'s would (``0644`` under umask ``022``).

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
    tmp = f".{name}.{secrets.token_hex(6)}.tmp{ext}"
    with deferred_termination():
        create_file(folder, tmp, write, write_path=write_path)
        try:
            os.replace(os.path.join(folder, tmp), path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, tmp))
            raise
        _fsync_dir(folder)
    return path


def create_file(folder: str, name: str, write: Callable[[IO[bytes]], None] | None = None,
                *, write_path: Callable[[str], None] | None = None) -> int:
    """Create ``folder/name``, which must not exist (``O_EXCL``, no symbolic link
    followed, mode ``0666`` less the umask), write it with ``write`` (an open file) or
    ``write_path`` (a path), ``fsync`` it; its size in bytes. Removed again when the
    write fails or is interrupted; SIGINT and SIGTERM wait until it is complete."""
    path = os.path.join(folder, name)
    with deferred_termination():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
        try:
            if write_path is not None:
                os.close(fd)
                fd = -1
                write_path(path)
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                os.fsync(fd)
                return os.fstat(fd).st_size
            if write is None:
                raise TypeError("create_file needs write or write_path")
            with os.fdopen(fd, "wb") as fh:
                fd = -1
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
                return os.fstat(fh.fileno()).st_size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)


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




# -- sharded saves: one step whole, or the previous one --------------------------------
#
# A sharded save (``save_sharded`` of every binding) writes every file of a step under
# new names that carry the step's random id (``optim.<id>.<r>-of-<N>.pt``,
# ``model.<id>.pt``...), then replaces the folder's one index (``meta.pt`` or
# ``meta.json``) atomically: the index names every file of the step and its size, so a
# load finds one whole step (model and optimizer together) or raises. Before any file
# of a step exists, the first rank records its names in ``.ronde-save.<id>.json``; the
# next save removes the files such a record names (a save cut short: Ctrl-C, a crash)
# and, once a step is committed, the files of the step it replaced. Nothing else in the
# folder is ever removed or overwritten: every file is created with ``O_EXCL``.

#: the prefix of a save's record of the files it creates
RECORD_PREFIX = ".ronde-save."
#: the most bytes an index or a record may have (a folder's JSON is read whole)
_INDEX_LIMIT_BYTES = 64 << 20


def member_name_ok(name: object) -> bool:
    """Whether ``name`` is a plain file name of the folder: no path, no ``..``."""
    return (isinstance(name, str) and 0 < len(name) < 256 and name not in (".", "..")
            and "/" not in name and "\0" not in name and os.sep not in name)


def open_member(directory: str, name: object, size_bytes: object = None,
                index: str = "") -> IO[bytes]:
    """Open ``directory/name``, a file a checkpoint's index names, for reading: only a
    plain name of the folder, a regular file (not a symbolic link, FIFO or device: never
    a read that blocks), of ``size_bytes`` when the index recorded it.

    Raises:
        RondeError: naming the file, the index and what is wrong with it.
        FileNotFoundError: when it is missing.
    """
    from ._errors import RondeError

    where = f" (named by {index})" if index else ""
    if not member_name_ok(name):
        raise RondeError(f"{directory}: the checkpoint's index names {name!r}{where}, which "
                         "is not a file of its folder; refusing to read it (a checkpoint "
                         "names only files beside its index: rewrite it with save_sharded)")
    assert isinstance(name, str)
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}{where} is missing: the checkpoint is incomplete "
                                "(files removed or never copied)") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RondeError(f"{path}{where} is a symbolic link; a checkpoint's files are "
                             "regular files of its folder") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RondeError(f"{path}{where} is not a regular file (a FIFO, device or "
                             "folder); a checkpoint's files are regular files")
        if isinstance(size_bytes, int) and st.st_size != size_bytes:
            raise RondeError(f"{path}{where} has {st.st_size} bytes, the index says "
                             f"{size_bytes}: changed or cut short since the save")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_index(directory: str, name: str) -> bytes:
    """The bytes of a sharded save's index ``directory/name`` (:func:`open_member`'s
    checks); ``FileNotFoundError`` when it is missing."""
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} is missing: not a save_sharded() folder, or no "
                                "save completed")
    with open_member(directory, name) as fh:
        return fh.read(_INDEX_LIMIT_BYTES)


class ShardedSave:
    """One step of a sharded save, as every rank holds it (:func:`begin_sharded_save`).

    Attributes:
        directory: the folder.
        token: the step's id, in every file name of the step.
        writer: whether this rank writes a file (every rank of a sharded state; only
            rank 0 of an unsharded one).
        committer: whether this rank writes the model and the index (the first rank).
        together: whether the job has several ranks (a barrier ends the save).
    """

    def __init__(self, directory: str, index: str, token: str, writer: bool,
                 committer: bool, together: bool, replaces: list[str]) -> None:
        self.directory, self.index, self.token = directory, index, token
        self.writer, self.committer, self.together = writer, committer, together
        self._replaces = replaces

    def write(self, name: str, write: Callable[[IO[bytes]], None] | None = None, *,
              write_path: Callable[[str], None] | None = None) -> int:
        """Create the step's file ``name`` (:func:`create_file`); its size in bytes."""
        if f".{self.token}." not in name:
            raise ValueError(f"{name!r} is not a file of step {self.token}")
        return create_file(self.directory, name, write, write_path=write_path)

    def commit(self, write_index: Callable[[IO[bytes]], None], names: list[str]) -> None:
        """Replace the index with the one ``write_index`` writes (naming ``names``), then
        remove the files of the step it replaced and this step's record."""
        tmp = _index_tmp(self.index, self.token)
        self.write(tmp, write_index)
        with deferred_termination():
            try:
                os.replace(os.path.join(self.directory, tmp),
                           os.path.join(self.directory, self.index))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, tmp))
                raise
            _fsync_dir(self.directory)
        _remove_files(self.directory, self._replaces, keep=set(names))
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(self.directory, f"{RECORD_PREFIX}{self.token}.json"))


def sharded_file_names(token: str, size: int, ext: str) -> list[str]:
    """Every rank's file of step ``token`` of a sharded save (``save_sharded`` of every
    binding): ``optim.<token>.<rank>-of-<size><ext>``."""
    return [f"optim.{token}.{r}-of-{size}{ext}" for r in range(size)]


def check_sharded_index(decoded: Any, where: str, fmt: str, legacy_model: str) -> dict[str, Any]:
    """``decoded`` (a sharded save's index, read from ``where``) checked to be of
    format ``fmt`` (or the same name's version 1, whose model file was ``legacy_model``)
    and to name one file per rank; version 1 gains the fields it lacked."""
    from ._errors import RondeError

    meta: dict[str, Any] = decoded if isinstance(decoded, dict) else {}
    legacy = fmt.rsplit("/", 1)[0] + "/1"
    found = decoded.get("format") if isinstance(decoded, dict) else type(decoded).__name__
    if found not in (fmt, legacy):
        raise RondeError(f"{where}: unknown format {found!r} (expected {fmt!r}; not a "
                         "save_sharded() index)")
    files, pieces = meta.get("files"), meta.get("pieces")
    if not (isinstance(files, list) and isinstance(pieces, list)
            and len(files) == len(pieces) == meta.get("world_size")):
        raise RondeError(f"{where}: its files and pieces do not match its world size; "
                         "the index is damaged")
    if found == legacy:  # before each step's files carried its id
        meta.update(sizes=[None] * len(files), model=legacy_model, model_size=None)
    return meta


def previous_step(directory: str, index: str, read: Callable[[], dict[str, Any]]
                  ) -> tuple[str, list[str]] | None:
    """The id and files of the step that ``directory``'s index names now (read and
    checked by ``read``), for the next save to remove; None where there is none or it
    cannot be read (a damaged index: its files stay, unnamed)."""
    if not os.path.lexists(os.path.join(directory, index)):
        return None
    try:
        meta = read()
    except Exception as exc:  # noqa: BLE001 - logged; the files stay
        log.warning("%s: cannot read the previous index (%s); its files stay", directory, exc)
        return None
    return str(meta.get("id")), [*(str(f) for f in meta["files"]),
                                 *([str(meta["model"])] if meta.get("model") else [])]


def _index_tmp(index: str, token: str) -> str:
    return f".{index}.{token}.tmp"


def begin_sharded_save(directory: str, index: str, many: bool, first: bool,
                       process_set: "ProcessSet", names: Callable[[str], list[str]],
                       current: Callable[[], tuple[str, list[str]] | None]) -> ShardedSave:
    """The first step of a sharded save (``save_sharded`` of every binding).

    Args:
        directory: the folder (made if missing).
        index: the index's name (``meta.pt``, ``meta.json``).
        many: whether several ranks each write a slice (then they share one id, the
            first rank's).
        first: whether this rank is the first of the save's ranks (it commits).
        process_set: the ranks that save together.
        names: every file a step of this id creates (each carries the id).
        current: the id of the step the folder's index names now and that step's
            files, or None (no index yet).

    On the committing rank, the records of earlier saves are settled first (their files
    removed, or the files of the step they replaced), then this step's record is
    written; only then do the other ranks learn the id and write.
    """
    from . import _api, _objects

    together = _api.is_initialized() and _api.size() > 1
    writer = many or not together or _api.rank() == 0
    committer = writer and first
    token = secrets.token_hex(6)
    replaces: list[str] = []
    if committer:
        os.makedirs(directory, exist_ok=True)
        now = current()
        settle_records(directory, index, now)
        replaces = [n for n in (now[1] if now else []) if f".{now[0]}." in n] if now else []
        record = {"token": token, "files": [*names(token), _index_tmp(index, token)],
                  "replaces": replaces}
        create_file(directory, f"{RECORD_PREFIX}{token}.json",
                    lambda fh: fh.write(json.dumps(record).encode()))
    if many:
        ranks = process_set.ranks
        token = _objects.broadcast_object(token, ranks[0] if ranks else 0,
                                          "ronde.save_sharded.id", process_set)
    return ShardedSave(directory, index, token, writer, committer, together, replaces)


def settle_records(directory: str, index: str,
                   current: tuple[str, list[str]] | None) -> None:
    """Finish what earlier saves left in ``directory``: for each record of a step the
    index does not name (a save cut short), remove that step's files; for the record
    of the step it names (committed, its clean-up cut short), the files of the step it
    replaced. A file the index names is never removed; nor is any file whose name
    lacks the recorded step's id. Then the record goes."""
    keep = set(current[1]) if current else set()
    for entry in sorted(os.listdir(directory)):
        if not (entry.startswith(RECORD_PREFIX) and entry.endswith(".json")):
            continue
        try:
            with open_member(directory, entry) as fh:
                record = json.loads(fh.read(_INDEX_LIMIT_BYTES))
            token = record["token"]
            doomed = record["replaces"] if current and token == current[0] else record["files"]
            if not (isinstance(token, str) and isinstance(doomed, list)
                    and entry == f"{RECORD_PREFIX}{token}.json"):
                raise ValueError("not a record of ronde's")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: leaving %s alone: %s", directory, entry, exc)
            continue
        # a replaced step's files carry its own id; a cut-short step's carry this one
        _remove_files(directory, [n for n in doomed if isinstance(n, str)
                                  and (doomed is record["replaces"] or f".{token}." in n)],
                      keep)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, entry))


def _remove_files(directory: str, names: list[str], keep: set[str]) -> None:
    """Remove each of ``names`` that is a regular file of ``directory`` (not a link)
    and not in ``keep``."""
    for name in names:
        if name in keep or not member_name_ok(name):
            continue
        path = os.path.join(directory, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
        except OSError:
            pass
