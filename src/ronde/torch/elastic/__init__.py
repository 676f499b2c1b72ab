"""Elastic training with PyTorch: ``hvd.elastic.run``, ``TorchState``, ``ElasticSampler``.

Horovod's ``horovod.torch.elastic`` API; the reset loop and the exactly-once sampling
are ronde's shared ones (:mod:`ronde.elastic`). See docs/elastic.md.
"""

from __future__ import annotations

from ...elastic import (HorovodInternalError, HostsUpdatedInterrupt, HostUpdateResult,
                        ObjectState, State, run, run_fn)
from .sampler import ElasticSampler
from .handler import StateHandler
from .sharded import ShardedOptimizerHandler
from .state import (ModelStateHandler, OptimizerStateHandler, SamplerStateHandler, TorchState,
                    get_handler_registry, set_handler_registry)

__all__ = ["ElasticSampler", "HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt",
           "ModelStateHandler", "ObjectState", "OptimizerStateHandler", "SamplerStateHandler",
           "ShardedOptimizerHandler",
           "State", "StateHandler", "TorchState", "get_handler_registry", "run", "run_fn",
           "set_handler_registry"]
