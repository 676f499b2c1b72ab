"""Picklable Python objects as collectives: ``broadcast_object``, ``allgather_object``.

Each is two collectives of the numpy facade (:mod:`ronde._api`): the pickled lengths,
then the bytes. Every binding's ``broadcast_object``/``allgather_object`` is this one.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from ._api import allgather, auto_name, broadcast, rank
from .process_sets import ProcessSet


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Broadcast a picklable object from ``root_rank``; returns it on every rank."""
    base = auto_name("broadcast_object", name, process_set)
    payload = _dumps(obj) if rank() == root_rank else np.zeros(0, np.uint8)
    length = broadcast(np.array([payload.size], dtype=np.int64), root_rank, f"{base}.len",
                       process_set)
    buf = payload if rank() == root_rank else np.empty(int(length[0]), np.uint8)
    data = broadcast(buf, root_rank, f"{base}.data", process_set)
    return obj if rank() == root_rank else pickle.loads(data.tobytes())


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list[Any]:
    """Gather a picklable object from every rank; returns the list in rank order."""
    base = auto_name("allgather_object", name, process_set)
    payload = _dumps(obj)
    sizes = allgather(np.array([payload.size], dtype=np.int64), f"{base}.len", process_set)
    data = allgather(payload, f"{base}.data", process_set)
    out, off = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[off: off + n].tobytes()))
        off += n
    return out


def _dumps(obj: Any) -> np.ndarray:
    buf = io.BytesIO()
    pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()
