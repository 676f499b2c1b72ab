"""Wrapping a constructed optimizer in a dynamic subclass that shares its attributes.

``DistributedOptimizer`` (and its Adasum form, ``adasum.py``) returns an object of a
subclass of the user's optimizer class, made without ``__init__``, whose instance
dictionary *is* the original's: one ``__dict__``, not a copy (Horovod builds a new
optimizer over the same parameter groups). So whatever still refers to the original
(an LR scheduler made before wrapping holds it as ``scheduler.optimizer``) and whatever
rebinds attributes (``load_state_dict()`` replaces ``state`` and ``param_groups``) sees
one optimizer, not two that drift apart.

An instance attribute named like a method that the wrapper layers over the optimizer's
own (:data:`LAYERED`) would hide the wrapper's method. The usual one is the counter
every LR scheduler puts on ``optimizer.step`` when it is made; copied along with the
dictionary, it made the wrapper's ``step()`` skip the reduction. Such a patch becomes
the wrapper's *inner* call instead (:func:`inner`, where ``super()`` would be), and the
instance attribute is replaced by the wrapper's method carrying the patch's attributes
(the scheduler's ``_wrapped_by_lr_sched`` mark): the original and the wrapper then both
run the wrapper's method, and the patch still sees every call.

The original object lives as long as the wrapper (the new class holds it): such a
patch reaches the optimizer through a weak reference to the *original* (torch's LR
scheduler sets ``_opt_called`` on it), and a caller that keeps only the wrapper
(Lightning's strategy points ``scheduler.optimizer`` at it) would otherwise free the
original and the scheduler's first step would fail on a dead reference.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

#: methods a wrapper may define over the optimizer's own (reaching those by :func:`inner`)
LAYERED = ("step", "zero_grad")

_PATCHES = "_ronde_patches"  # name -> the instance-level patch the wrapper layered over
_WRAPPED = "_ronde_wrapped"  # set once a wrapper shares this dictionary


def wrap(optimizer: Any, mixin: type, init: Callable[[Any], None], what: str) -> Any:
    """An object of ``mixin`` over ``type(optimizer)`` sharing ``optimizer``'s attributes.

    Args:
        optimizer: a constructed optimizer.
        mixin: the wrapper's methods, placed first in the new class's MRO.
        init: sets the wrapper up; if it raises, the attributes it added are removed and
            the optimizer is left as it was.
        what: the wrapper's name, for errors.

    Raises:
        ValueError: ``optimizer`` is wrapped already (or is itself a wrapper): a second
            wrapper would share the first one's bookkeeping.
    """
    shared = optimizer.__dict__
    if shared.get(_WRAPPED):
        raise ValueError(f"{what}: this {type(optimizer).__name__} is wrapped already; wrap "
                         "an optimizer once and use the object the first call returned")
    base = optimizer.__class__
    # the class holds the original (no cycle through the shared dictionary): patches
    # that reach it by a weak reference keep working while the wrapper lives
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__,
                                              "_ronde_original": optimizer})
    wrapped = cls.__new__(cls)
    wrapped.__dict__ = shared
    before = set(shared)
    try:
        init(wrapped)
    except BaseException:
        for key in set(shared) - before:
            del shared[key]
        raise
    patches = {name: shared[name] for name in LAYERED if name in shared and name in vars(mixin)}
    for name, patch in patches.items():
        shared[name] = _layered(wrapped, name, patch)
    shared[_PATCHES] = patches
    shared[_WRAPPED] = True
    return wrapped


def _layered(wrapped: Any, name: str, patch: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper's method ``name``, dressed as ``patch`` (its name, its attributes)."""

    @functools.wraps(patch)
    def layered(*args: Any, **kwargs: Any) -> Any:
        return getattr(type(wrapped), name)(wrapped, *args, **kwargs)

    return layered


def inner(wrapped: Any, mixin: type, name: str) -> Callable[..., Any]:
    """The optimizer's own method ``name`` under ``mixin``'s: the instance-level patch
    that :func:`wrap` layered over, else the base class's."""
    patch = wrapped.__dict__.get(_PATCHES, {}).get(name)
    return patch if patch is not None else getattr(super(mixin, wrapped), name)


class SkipSynchronize:
    """``skip_synchronize()`` of the gradient-averaging wrappers (mixed in with them)."""

    _ronde_should_sync: bool

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block ``step()`` does not synchronize (you called
        ``synchronize()``, e.g. to clip the averaged gradients first)."""
        self._ronde_should_sync = False
        try:
            yield
        finally:
            self._ronde_should_sync = True
