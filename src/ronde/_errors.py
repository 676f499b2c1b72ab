"""The ronde error family.

Every error says what failed, for which tensor and ranks, what was expected, and
the fix. They all derive from :class:`RondeError`, so ``except ronde.RondeError``
catches anything the library raises on purpose.
"""

from __future__ import annotations


class RondeError(RuntimeError):
    """Base class of every error ronde raises deliberately."""


class ConfigError(RondeError, ValueError):
    """A configuration value (environment variable or flag) is invalid."""


class NotInitializedError(RondeError, ValueError):
    """A call needs ``ronde.init()`` first."""


class HorovodInternalError(RondeError):
    """A collective failed (on every rank that took part), as Horovod names it.

    The base of the errors a collective itself raises (mismatched metadata, a lost
    peer, a stall, crossed collectives, a shutdown, a join): ``except
    hvd.HorovodInternalError`` works as it does with Horovod. ``CollectiveError`` is
    the same class under ronde's own name.
    """


CollectiveError = HorovodInternalError


class UnsupportedError(RondeError, ValueError):
    """An operation or option that ronde (or this collective) does not support."""


class ArgumentError(RondeError, ValueError):
    """A collective's arguments do not fit together (splits, a first dimension): a
    ``ValueError``, and a ``RuntimeError`` as Horovod's frameworks raise it."""


class ProcessSetError(RondeError, ValueError):
    """A process set used wrongly: not registered, or called by a rank outside it."""


class TensorMismatchError(HorovodInternalError, ValueError):
    """Ranks submitted the same named collective with different metadata."""


class DuplicateNameError(HorovodInternalError, ValueError):
    """A tensor name was submitted again while the first request is in flight."""


class PeerLostError(HorovodInternalError, ConnectionError):
    """A peer process died or its connection broke."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class StallError(HorovodInternalError, TimeoutError):
    """Some ranks submitted a collective that others never did."""


class DeadlockError(StallError):
    """Every rank is waiting for a collective that some other rank never submitted.

    Raised on every rank within ``RONDE_DEADLOCK_TIME`` seconds of the ranks falling
    out of step (one rank left a loop or a test early, or took another branch), instead
    of each waiting forever for the others.
    """


class RendezvousError(RondeError, TimeoutError):
    """Start-up failed: ranks missing, host unreachable, or a wrong address."""


class AuthenticationError(RondeError, PermissionError):
    """A peer does not hold this job's secret."""


class SecurityError(RondeError):
    """A file or shared-memory segment that ronde makes or reads outside the user's own
    folders is not what only this user could have made: another user's, a link, open to
    others. Raised before anything in it is trusted; the message names the path and the
    fix (see docs/security.md, local users)."""


class ProtocolError(RondeError, ValueError):
    """Bytes received from a peer are malformed."""


class ShutdownError(HorovodInternalError):
    """The engine was shut down (locally or by a peer) while work was pending.

    ``rank``: the peer whose shutdown left this collective without it, if one did.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class JoinedError(HorovodInternalError, ValueError):
    """An operation other than allreduce ran while some ranks had joined."""


class HostsUpdatedInterrupt(RondeError):
    """Raised at the same ``State.commit()`` on every rank of an elastic job when the
    launcher added or removed hosts: ``hvd.elastic.run`` re-forms the job, keeping the
    progress since the last commit. ``skip_sync``: only hosts were removed, so every
    remaining rank already holds the state."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of this elastic job changed" +
                         (" (removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync


class WorkerRemovedError(RondeError):
    """This elastic worker's slot is not in the re-formed job (its host was removed,
    or the job shrank to ``--max-np``); ``hvd.elastic.run`` ends the process with code 0."""


for _cls in list(globals().values()):
    if isinstance(_cls, type) and issubclass(_cls, RondeError):
        _cls.__module__ = "ronde"  # tracebacks say ronde.PeerLostError, the public name


def fresh_copy(exc: BaseException) -> BaseException:
    """A new exception of the same type and message, so that every caller that raises a
    recorded failure gets its own traceback (a ``PeerLostError`` keeps its rank)."""
    try:
        new = type(exc)(*exc.args)
        if isinstance(exc, PeerLostError):
            new.rank = exc.rank
        return new
    except Exception:  # noqa: BLE001 - an exception type with another signature
        return exc
