"""Broadcasting Gluon parameters (or a dict of NDArrays) from one rank.

``broadcast_parameters(net.collect_params(), root_rank=0)`` overwrites every rank's
parameter values with the root's, in place, in every context. A parameter whose
initialisation is still deferred (its shape is only known after the first forward
pass) is broadcast right after that initialisation instead: its ``_init_impl`` is
wrapped once, as Horovod does. Parameters go in sorted name order, each as the
collective ``<prefix>.<name>``; all are submitted before any is awaited.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Mapping

import mxnet as mx
import numpy as np

from .. import _api
from ..process_sets import ProcessSet, global_process_set
from . import _collectives as C

logger = logging.getLogger(__name__)


def _broadcast_arrays(items: list[tuple[str, Any]], root_rank: int, prefix: str,
                      process_set: ProcessSet) -> None:
    """Broadcast ``(name, NDArray or Parameter)`` items in place."""
    hosts = []
    for name, value in items:
        data = value.data() if isinstance(value, mx.gluon.Parameter) else value
        hosts.append((value, C.to_host(data, f"broadcast_parameters {name!r}")))
    handles = [_api.broadcast_async(h, root_rank, f"{prefix}.{name}", process_set)
               for (name, _), (_, h) in zip(items, hosts)]
    for (value, _), handle in zip(hosts, handles):
        out = np.asarray(handle.wait())
        if isinstance(value, mx.gluon.Parameter):
            value.set_data(mx.nd.array(out, dtype=out.dtype))
        else:
            C.write_back(value, out)


def _broadcast_after_init(param: mx.gluon.Parameter, name: str, root_rank: int, prefix: str,
                          process_set: ProcessSet) -> None:
    original = param._init_impl

    def init_then_broadcast(self: mx.gluon.Parameter, *args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        self._init_impl = original  # once
        _broadcast_arrays([(name, self)], root_rank, prefix, process_set)

    param._init_impl = types.MethodType(init_then_broadcast, param)


def broadcast_parameters(params: Any, root_rank: int = 0, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    Args:
        params: ``net.collect_params()`` (a ``ParameterDict``), or a dict of names to
            ``gluon.Parameter`` or ``mx.nd.NDArray`` (e.g. a Module's ``arg_params``).
        root_rank: the rank whose values everyone gets.
        prefix: prepended to the collective names (default ``broadcast_parameters``).
        process_set: the ranks taking part (default: all).

    Raises:
        ValueError: ``params`` is not a dict of parameters or arrays.
    """
    if not isinstance(params, Mapping) and not hasattr(params, "items"):
        raise ValueError(f"broadcast_parameters: invalid params of type "
                         f"{type(params).__name__}; pass net.collect_params() or a dict of "
                         "NDArrays")
    base = prefix or "broadcast_parameters"
    ready: list[tuple[str, Any]] = []
    for name, value in sorted(params.items(), key=lambda kv: str(kv[0])):
        if isinstance(value, mx.gluon.Parameter):
            try:
                value.data()
            except mx.gluon.parameter.DeferredInitializationError:
                _broadcast_after_init(value, str(name), root_rank, base, process_set)
                continue
            ready.append((str(name), value))
        elif isinstance(value, mx.nd.NDArray):
            ready.append((str(name), value))
        else:
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(value).__name__}; "
                             "expected a gluon.Parameter or an mx.nd.NDArray")
    _broadcast_arrays(ready, root_rank, base, process_set)
