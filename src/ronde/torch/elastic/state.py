"""``TorchState``: models, optimizers and samplers kept across resets, by handler.

Each keyword argument whose type has a handler (a ``torch.nn.Module``, a
``torch.optim.Optimizer``, an :class:`ElasticSampler`; the registry can be changed with
:func:`set_handler_registry`) is saved, restored and synced by it; the rest are plain
objects (:class:`ronde.elastic.ObjectState`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from ...elastic import ObjectState
from .._sharded_mixin import _ShardedMixin
from .handler import StateHandler
from .sharded import ShardedOptimizerHandler
from ..state import broadcast_optimizer_state, broadcast_parameters
from .sampler import ElasticSampler


class _StateDictHandler(StateHandler):
    """Saves a deep copy of ``value.state_dict()``; restores it with ``load_state_dict``."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class ModelStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(_StateDictHandler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateHandler):
    """Saving gathers every rank's records first (a collective, as ``commit()`` is)."""

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._saved = copy.deepcopy(sampler.state_dict())

    def save(self) -> None:
        self.value.shards.gather()
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def reset(self) -> None:
        self.value.reset()  # deal the shards for the new rank and size, synced or not

    def sync(self) -> None:
        from ..._objects import broadcast_object

        self.value.load_state_dict(broadcast_object(self.value.state_dict(),
                                                    name="ronde.elastic.sampler_state"))


_registry: list[tuple[type, Callable[[Any], StateHandler]]] = [
    (_ShardedMixin, ShardedOptimizerHandler),  # before Optimizer: it is one
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry() -> list[tuple[type, Callable[[Any], StateHandler]]]:
    return _registry


def set_handler_registry(registry: list[tuple[type, Callable[[Any], StateHandler]]]) -> None:
    global _registry
    _registry = registry


def _handler(value: Any) -> StateHandler | None:
    for kind, handler in _registry:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """State of a PyTorch training process: ``TorchState(model, optimizer, epoch=0,
    batch=0, sampler=sampler)``; every argument becomes an attribute."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            h = _handler(value)
            if h is not None:
                handlers[name] = h
            else:
                plain[name] = value
        object.__setattr__(self, "_handlers", handlers)
        for name, h in handlers.items():
            object.__setattr__(self, name, h.value)
        super().__init__(**plain)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self) -> None:
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def reset(self) -> None:
        for h in self._handlers.values():
            h.reset()

    @property
    def sync_after_reset(self) -> bool:
        """Whether ``sync()`` must run after every reset, even one that removed hosts
        only (a sharded optimizer's slices are laid out again at every size)."""
        return any(getattr(h, "sync_after_reset", False) for h in self._handlers.values())

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers")
        if handlers is not None and name in handlers:
            handlers[name].set_value(value)
        object.__setattr__(self, name, value)
