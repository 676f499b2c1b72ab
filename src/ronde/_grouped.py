"""Grouped collectives: a list of tensors as one call, ``<name>.<i>`` each.

Each member is the numpy facade's own collective (:mod:`ronde._api`), all submitted
inside one ``together()`` block, so the engine negotiates and fuses them in one round;
unnamed groups take the next automatic name of their kind on the process set. The
framework bindings build their grouped forms on these, or on their own single
collectives inside ``together()`` the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._api import allgather_async, allreduce_async, group_names, reducescatter_async, together
from .core.requests import GroupOfHandles
from .process_sets import ProcessSet


def grouped_allreduce_async(tensors: Sequence[Any], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None) -> GroupOfHandles:
    """Start an allreduce of every tensor in the list (negotiated and fused together)."""
    names = group_names("grouped_allreduce", name, len(tensors), process_set)
    with together():
        return GroupOfHandles([allreduce_async(t, average, n, op, prescale_factor,
                                               postscale_factor, process_set)
                               for n, t in zip(names, tensors)])


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Allreduce a list of tensors; returns the list of results."""
    return grouped_allreduce_async(tensors, average, name, op, prescale_factor,
                                   postscale_factor, process_set).wait()


def grouped_allgather_async(tensors: Sequence[Any], name: str | None = None,
                            process_set: ProcessSet | None = None) -> GroupOfHandles:
    """Start an allgather of every tensor in the list (``<name>.<i>`` each)."""
    names = group_names("grouped_allgather", name, len(tensors), process_set)
    with together():
        return GroupOfHandles([allgather_async(t, n, process_set)
                               for n, t in zip(names, tensors)])


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      process_set: ProcessSet | None = None) -> list[np.ndarray]:
    """Allgather a list of tensors; returns the list of results."""
    return grouped_allgather_async(tensors, name, process_set).wait()


def grouped_reducescatter_async(tensors: Sequence[Any], op: Any = None, name: str | None = None,
                                process_set: ProcessSet | None = None,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> GroupOfHandles:
    """Start a reducescatter of every tensor in the list (``<name>.<i>`` each)."""
    names = group_names("grouped_reducescatter", name, len(tensors), process_set)
    with together():
        return GroupOfHandles([reducescatter_async(t, op, n, process_set, prescale_factor,
                                                   postscale_factor)
                               for n, t in zip(names, tensors)])


def grouped_reducescatter(tensors: Sequence[Any], op: Any = None, name: str | None = None,
                          process_set: ProcessSet | None = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[np.ndarray]:
    """Reducescatter a list of tensors; returns the list of this rank's blocks."""
    return grouped_reducescatter_async(tensors, op, name, process_set, prescale_factor,
                                       postscale_factor).wait()
