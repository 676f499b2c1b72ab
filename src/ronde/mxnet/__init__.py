"""ronde for MXNet: Horovod's ``horovod.mxnet`` API on ronde's engine.

A Horovod Gluon script runs with only its import changed::

    import mxnet as mx
    import ronde.mxnet as hvd

    hvd.init()
    net = build_net()
    net.initialize(mx.init.Xavier())
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": 0.1 * hvd.size()})
    for x, y in batches:
        with mx.autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])          # the per-rank batch size

Arrays cross through host memory (``asnumpy()``). MXNet 1.9.1 needs numpy<1.24, so
it lives in its own virtual environment (``scripts/mxnet_tests.sh`` builds one).
See docs/mxnet.md.
"""

from __future__ import annotations

from .. import _facade

__all__ = _facade.export_common(globals())

from .._api import barrier, join  # noqa: E402,F401
from .._objects import allgather_object, broadcast_object  # noqa: E402,F401
from ..frameworks.compression import Compressor
from ..frameworks.compression import NUMPY_COMPRESSION as Compression
from ..process_sets import ProcessSet, global_process_set
from ._collectives import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_,
                           fused_allreduce_, grouped_allgather, grouped_allreduce,
                           grouped_allreduce_, grouped_reducescatter, reducescatter)
from .optimizer import DistributedOptimizer, DistributedTrainer
from .state import broadcast_parameters

