"""``ShardedOptimizer`` for Keras 3 on every backend: the optimizer's state split over the
ranks (ZeRO stage 1; docs/sharding.md).

The returned object is a subclass of the user's optimizer class (like
``DistributedOptimizer``'s), usable with ``model.compile``/``fit`` and with
``apply_gradients`` in custom loops. What it holds and does:

* Layout: the trainable variables, grouped by dtype in their order, form one flat vector
  per group of ``L`` elements padded to ``N * S`` (``S = ceil(L / N)``); rank ``r`` owns
  elements ``[r*S, (r+1)*S)``: split by elements, not by variables, as torch's and JAX's
  ``ShardedOptimizer``.
* State: per group one *shard* variable of ``S`` elements, and an *inner* optimizer (the
  user's class, from the user's config) built over the shards only, so its moments are
  ``1/N`` of the model's. The inner optimizer shares the outer one's learning rate (a
  ``LearningRateScheduler`` that sets ``optimizer.learning_rate`` reaches it); the outer
  one's ``variables`` list the inner's too, so ``stateless_apply`` (``fit`` on JAX) and
  Keras' checkpoints of the optimizer see every variable.
* A step (``apply``): one host call per group reduce-scatters the flat gradients
  (Average; ``compression`` casts on the wire) and gives this rank its ``S`` averaged
  elements; the shard takes this rank's current slice of the variables (so weights set
  from outside, such as a broadcast or ``set_weights``, are followed); the inner optimizer
  steps on the shard; a second host call allgathers the updated shards and splits them
  back into the variables: the traffic of one allreduce. Host calls run inside
  ``tf.function`` and ``jax.jit`` as ``DistributedOptimizer``'s do (:mod:`._bridge`).

An elastic resize lays the shards out again (``KerasState.sync``): new shard variables
and a new inner optimizer. A step traced before it (``fit``'s train function, which
``KerasState`` drops, or the user's own ``tf.function``/``jax.jit``) holds the old ones,
so each step's host call checks the layout it was traced in and refuses a stale one,
naming the fix; a reset that keeps every rank's place keeps the layout, and the trace.

Refused with the reason: optimizers whose step needs whole tensors (Lamb, Adafactor,
Muon), ``clipnorm``/``global_clipnorm`` (a norm over whole gradients), ``use_ema``,
``exclude_from_weight_decay`` (names are per variable, the shards have none), sparse
gradients, Adasum/Sum.

``backward_passes_per_step=k`` is Keras' own ``gradient_accumulation_steps=k`` on the
inner optimizer: the shard's averaged gradients accumulate (1/N of the model), and the
ranks reduce every pass (the traffic of stage 2's accumulation, not stage 1's).

``stage``: Keras computes every gradient of a step before the optimizer sees one, so
there is no backward pass to reduce-scatter from, and what stage 2 shards beyond stage 1
is the accumulated gradients, which this optimizer keeps as shards at either stage (the
paragraph above). ``stage=2`` is accepted and is the same optimizer (as
``ronde.jax.ShardedOptimizer(stage=2)``, whose stage 1 keeps the whole accumulator): code
written for ``ronde.torch``'s stage 2 runs unchanged.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from .. import _api, _state
from .._errors import UnsupportedError
from .._ops import ReduceOp
from ..frameworks.compression import Compresses, host_compressor, wire_dtype_of
from ..frameworks.elementwise import check_elementwise
from ..frameworks.gradients import Reduction
from ..frameworks import reshard
from ..frameworks.shard_layout import ShardLayout, Span, spans_by_kind
from ..frameworks.naming import require_same_parameters
from ..process_sets import ProcessSet, global_process_set, shard_position
from ._bridge import host_map
from ._choice import keras_module
from .optimizer import is_keras2, mixed_class, optimizer_name

#: the variables that hold this rank's slice (the shards and the inner optimizer's slots),
#: by id: every broadcast of optimizer variables leaves them alone (rank 0's slice would
#: replace this rank's); weak, so a dropped layout's variables leave with it
_SLICES: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()

#: Keras optimizers whose update treats every element on its own: any split is exact
ELEMENTWISE = frozenset({"SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
                         "Adadelta", "Ftrl", "Lion"})


class KerasLayout(ShardLayout):
    """A Keras ``ShardedOptimizer``'s layout (``optimizer.shard_layout``, None before it
    is built; a new one after an elastic resize): one span per dtype over the trainable
    variables, keyed by :func:`variable_key`, and what holds this rank's slices."""

    def __init__(self, variables: list[Any], rank: int, size: int, process_set: ProcessSet,
                 serial: int) -> None:
        kinds = []
        for i, v in enumerate(variables):
            dt = str(v.dtype)
            if not np.issubdtype(np.dtype(dt), np.floating):
                raise UnsupportedError(f"ShardedOptimizer: variable {_path(v, i)!r} is {dt}; "
                                       "only floating-point variables can be sharded")
            kinds.append(dt)
        super().__init__(spans_by_kind(kinds, [int(np.prod(v.shape)) for v in variables], size),
                         [variable_key(variables, i) for i in range(len(variables))],
                         rank, size, process_set)
        self.dtypes = [kinds[s.members[0]] for s in self.spans]  #: each span's dtype
        self.shapes = [tuple(v.shape) for v in variables]
        #: each span's ``(variable, a, b)`` that this rank owns
        self.owned = [s.owned(rank) for s in self.spans]
        #: counts the layouts: a step traced (``tf.function``, ``jax.jit``) in an earlier
        #: one holds the old shard variables and slices, and refuses to run
        self.serial = serial
        self.generation = _state.require().generation  #: the job's, when laid out
        self.shards: list[Any] = []  #: each span's shard variable (``S`` elements)
        self.inner: Any = None  #: the inner optimizer over the shards


class _ShardedMixin:
    """Methods mixed in front of the user's Keras optimizer class (module docstring)."""

    _ronde_cfg: dict[str, Any]
    #: the layout (:class:`KerasLayout`), the one object checkpoints and the elastic
    #: state read; None before the first build
    shard_layout: KerasLayout | None = None

    # -- building ----------------------------------------------------------------------
    def build(self, var_list: Sequence[Any]) -> None:
        if getattr(self, "built", False):
            return
        keras = keras_module()
        var_list = list(var_list)
        cfg = self._ronde_cfg
        ps: ProcessSet = cfg["process_set"]
        rank, size = shard_position(ps)
        if size > 1 and os.environ.get("RONDE_ELASTIC") != "1":
            # (not in an elastic job: a worker that joins builds while the others are
            # elsewhere; there the first reduce-scatter's negotiation catches a mismatch)
            require_same_parameters(
                # by place, not path: Keras' generated paths depend on how many models
                # the process made before
                ((f"variable {i}", str(v.dtype), tuple(v.shape))
                 for i, v in enumerate(var_list)),
                f"{cfg['prefix']}.parameters", ps,
                "ShardedOptimizer: the trainable variables differ across ranks",
                "build the same model on every rank before the first step")
        # the base class's bookkeeping only: the user's class would create its slots for
        # the whole variables, which is what sharding avoids
        keras.optimizers.Optimizer.build(self, var_list)
        self._ronde_lay_out(var_list)

    def _ronde_lay_out(self, var_list: list[Any]) -> None:
        """The groups, the shard variables and the inner optimizer over them, for this
        rank's place in the process set now."""
        cfg = self._ronde_cfg
        rank, size = shard_position(cfg["process_set"])
        was = self.shard_layout
        layout = KerasLayout(var_list, rank, size, cfg["process_set"],
                             was.serial + 1 if was is not None else 1)
        layout.shards = [self.add_variable((span.per,), initializer="zeros", dtype=dt,
                                           name=f"ronde_shard_{k}")
                         for k, (span, dt) in enumerate(zip(layout.spans, layout.dtypes))]
        config = dict(cfg["inner_config"])
        config["name"] = f"{config.get('name') or 'optimizer'}_shard"
        if cfg["passes"] > 1:
            config["gradient_accumulation_steps"] = cfg["passes"]
        inner = cfg["base"].from_config(config)
        inner.build(layout.shards)
        # one learning rate for both (a ``LearningRateScheduler`` that sets the outer
        # one's reaches the steps), set past the inner's tracker: it is the outer's
        # variable, not the inner's
        _keep(inner, "_learning_rate", self._learning_rate)
        layout.inner = inner
        _keep(self, "shard_layout", layout)
        own = {id(v) for v in self._variables}
        for v in inner.variables:
            if id(v) not in own:
                self._track_variable(v)
        # this rank's own: the shards and every slot (a slot is a vector of S elements;
        # the step counts and the learning rate are scalars, the same on every rank)
        for v in list(layout.shards) + [v for v in inner.variables if len(v.shape)]:
            _SLICES[id(v)] = v

    def relayout(self) -> None:
        """Lay the shards out again for the job as it is now (after an elastic reset that
        changed this rank's place or the size): new shard variables and a new inner
        optimizer, zero, in place of the old ones (``KerasState.sync`` fills them from
        the committed slices, :mod:`ronde.frameworks.reshard`). A model's compiled
        train function traced the old ones: ``KerasState`` drops it."""
        was = self.shard_layout
        assert was is not None, "relayout() of a ShardedOptimizer that was never built"
        old = {id(v) for v in was.shards} | {id(v) for v in was.inner.variables}
        old -= {id(self._iterations), id(self._learning_rate)}  # the outer's own
        self._variables[:] = [v for v in self._variables if id(v) not in old]
        self._ronde_lay_out(list(self._trainable_variables))
        new = self.shard_layout.inner  # the step count (Adam's bias correction): the
        _step_count(new).assign(_step_count(was.inner))  # variable
        reshard.forget_traces()  # (JAX backend: a new train function would reuse a trace)

    # -- a step ------------------------------------------------------------------------
    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        """Reduce-scatter ``grads``, step the inner optimizer on this rank's shard,
        allgather the shards into the variables (module docstring)."""
        keras = keras_module()
        ops = keras.ops
        grads = list(grads)
        if not self.built:
            self.build(trainable_variables if trainable_variables is not None
                       else self._trainable_variables)
        variables = list(self._trainable_variables)
        if trainable_variables is not None and len(list(trainable_variables)) != len(variables):
            raise UnsupportedError(
                "ShardedOptimizer: apply() got a different list of variables than the "
                "optimizer was built with; a sharded optimizer steps on all of them at once")
        if len(grads) != len(variables):
            raise ValueError(f"ShardedOptimizer: {len(grads)} gradients for "
                             f"{len(variables)} variables")
        for g, v in zip(grads, variables):
            if type(g).__name__ == "IndexedSlices":
                raise UnsupportedError(
                    f"ShardedOptimizer: the gradient of {_path(v, 0)!r} is sparse "
                    "(IndexedSlices); sparse gradients have no element slices: use "
                    "DistributedOptimizer for this model")
        cfg = self._ronde_cfg
        ps: ProcessSet = cfg["process_set"]
        rank, size = shard_position(ps)
        wire = cfg["wire_dtype"]
        layout = self.shard_layout  # when traced (module docstring: stale traces)
        assert layout is not None  # (built above)
        serial = layout.serial
        scale = 1.0 if cfg["average_aggregated"] or cfg["passes"] == 1 else float(cfg["passes"])
        g_shards, present = [], []
        for k, (span, dt, shard) in enumerate(zip(layout.spans, layout.dtypes, layout.shards)):
            gs = [grads[i] if grads[i] is not None else ops.zeros_like(variables[i])
                  for i in span.members]
            present.append([grads[i] is not None for i in span.members])
            g_shards.append(host_map(lambda *a, span=span, dt=dt, k=k: [_reduce_scatter(
                a, span, dt, size, f"{cfg['prefix']}.{k}.grads", ps, wire, scale,
                self._ronde_checked(serial))],
                gs, f"ronde_{cfg['prefix']}_rs{k}", outs=[((span.per,), dt)])[0])
            shard.assign(_my_slice(ops, variables, span, layout.owned[k], dt))
        inner = layout.inner
        if inner._learning_rate is not self._learning_rate:  # replaced (a schedule set)
            _keep(inner, "_learning_rate", self._learning_rate)
        inner.apply(g_shards, layout.shards)
        for k, (span, dt, shard) in enumerate(zip(layout.spans, layout.dtypes, layout.shards)):
            shapes = [layout.shapes[i] for i in span.members]
            outs = host_map(lambda a, span=span, dt=dt, shapes=shapes, k=k: _allgather(
                a, span, dt, shapes, size, f"{cfg['prefix']}.{k}.params", ps),
                [shard.value], f"ronde_{cfg['prefix']}_ag{k}",
                outs=[(s, dt) for s in shapes])
            for i, new, has in zip(span.members, outs, present[k]):
                if has:
                    variables[i].assign(new)
        self.iterations.assign_add(1)
        return self.iterations

    def _ronde_checked(self, serial: int) -> int:
        """Host side, each step: the job generation the shards were laid out in, after
        refusing a step traced in an earlier layout (``serial``: the one it was traced
        in)."""
        layout = self.shard_layout
        assert layout is not None
        if serial != layout.serial:
            raise UnsupportedError(
                "ShardedOptimizer: this step was traced (tf.function, jax.jit) before the "
                "shards were laid out again for the resized job, and holds the old ones; "
                "trace it anew after the elastic state's sync() (fit does: KerasState "
                "drops model.train_function)")
        return layout.generation

    @property
    def stage(self) -> int:
        """The stage asked for (1 or 2: the same optimizer in Keras, module docstring)."""
        return int(self._ronde_cfg.get("stage", 1))

    @property
    def inner_optimizer(self) -> Any:
        """The optimizer over this rank's shards (None before the first build)."""
        return None if self.shard_layout is None else self.shard_layout.inner

    @property
    def process_set(self) -> ProcessSet:
        """The ranks that shard."""
        return self._ronde_cfg["process_set"]

    def whole_optimizer(self) -> Any:
        """A plain, unbuilt optimizer of the wrapped class and config (one process would
        hold the whole state in it: ``gather_sharded``'s export)."""
        return self._ronde_cfg["base"].from_config(dict(self._ronde_cfg["inner_config"]))

    @property
    def collective_prefix(self) -> str:
        """The prefix of this optimizer's collectives' names."""
        return self._ronde_cfg["prefix"]


def holds_slice(variable: Any) -> bool:
    """True for a variable of a ``ShardedOptimizer`` that holds this rank's slice (a shard,
    a slot of the inner optimizer): a broadcast must leave it alone."""
    return _SLICES.get(id(variable)) is variable


def replicated(variables: Iterable[Any]) -> list[Any]:
    """``variables`` less those holding a rank's slice (:func:`holds_slice`): what a
    broadcast from one rank may assign (the model's weights, step counts, learning
    rates)."""
    return [v for v in variables if not holds_slice(v)]


def _step_count(optimizer: Any) -> Any:
    """An optimizer's step-count variable (with ``gradient_accumulation_steps``,
    ``iterations`` is a value computed from it, not a variable)."""
    found = getattr(optimizer, "_iterations", None)
    return optimizer.iterations if found is None else found


def _keep(obj: Any, name: str, value: Any) -> None:
    """Set an attribute past Keras' tracker (which would track the shards twice)."""
    object.__setattr__(obj, name, value)


def variable_key(variables: list[Any], i: int) -> str:
    """A variable's key in checkpoints and reshards: its place among the trainable
    variables and its shape (Keras' own weight files go by order too: the paths Keras
    generates change with how many models the process made before)."""
    return f"{i}:{'x'.join(map(str, variables[i].shape))}"


def _path(v: Any, i: int) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or i)


def _my_slice(ops: Any, variables: list[Any], span: Span, owned: list[tuple[int, int, int]],
              dtype: str) -> Any:
    """This rank's ``S`` elements of the span's flat variables (zero padded); ``owned``:
    its ``(variable, a, b)``."""
    parts = [ops.reshape(variables[i], (-1,))[a:b] for i, a, b in owned]
    have = sum(b - a for _, a, b in owned)
    if have < span.per:
        parts.append(ops.zeros((span.per - have,), dtype=dtype))
    return parts[0] if len(parts) == 1 else ops.concatenate(parts)


def check_same_layout(optimizer: Any, generation: int | None = None) -> None:
    """Raise ``UnsupportedError`` when the job was re-formed (an elastic reset) since
    ``optimizer`` laid out its shards and nothing laid them out again
    (``KerasState.sync`` does, in memory)."""
    layout = getattr(optimizer, "shard_layout", None)
    built = (None if layout is None else layout.generation) if generation is None else generation
    if built is not None and _state.require().generation != built:
        raise UnsupportedError(
            "ShardedOptimizer: the job was resized (an elastic reset) since this optimizer "
            "laid out its shards; keep the model in a hvd.elastic.KerasState, whose sync() "
            "(the elastic loop calls it) reshards the state in memory, or save_sharded() "
            "before and load_sharded() into a new ShardedOptimizer after")


def _reduce_scatter(arrays: Sequence[np.ndarray], span: Span, dtype: str, size: int, name: str,
                    ps: ProcessSet, wire: str | None, scale: float,
                    generation: int) -> np.ndarray:
    """Host side: the span's flat, padded gradients averaged over the ranks; this
    rank's ``S`` of them."""
    check_same_layout(None, generation)
    flat = np.zeros(span.padded, dtype=dtype)
    for a, i in zip(arrays, span.members):
        o = span.offset[i]
        flat[o:o + span.sizes[i]] = np.asarray(a).reshape(-1)
    if size == 1:
        return flat * scale if scale != 1.0 else flat
    # the pipeline every binding's gradients take (frameworks/gradients.py): an fp16
    # Average travels as a Sum of predivided inputs, an overflow is named
    red = Reduction(int(ReduceOp.AVERAGE), 1.0, scale, host_compressor(wire), ps)
    members = None if ps is global_process_set else ps
    out = red.apply(flat, name, lambda sent, op, pre, post: _api.reducescatter(
        sent, op, name, members, pre, post))
    return np.asarray(out, dtype=dtype)


def _allgather(shard: np.ndarray, span: Span, dtype: str, shapes: list[tuple], size: int,
               name: str, ps: ProcessSet) -> list[np.ndarray]:
    """Host side: every rank's updated shard, split back into the span's variables."""
    shard = np.ascontiguousarray(shard, dtype=dtype)
    full = shard if size == 1 else _api.allgather(
        shard, name, None if ps is global_process_set else ps)
    return [full[span.offset[i]:span.offset[i] + span.sizes[i]].reshape(shape)
            for i, shape in zip(span.members, shapes)]


def sharded_class(base: type) -> type:
    """The sharded subclass of a Keras optimizer class (one per class)."""
    return mixed_class(_ShardedMixin, base)


def _check(optimizer: Any, elementwise: bool | None) -> None:
    """Refuse what a rank holding slices cannot compute (module docstring)."""
    if is_keras2(optimizer):
        raise UnsupportedError("ShardedOptimizer wraps Keras 3 optimizers; a Keras 2 "
                               "(tf_keras) optimizer is not supported: use "
                               "DistributedOptimizer")
    check_elementwise(optimizer, elementwise, "keras", ELEMENTWISE)
    for attr, why in (("clipnorm", "clips each gradient by its whole norm"),
                      ("global_clipnorm", "clips by the norm of all gradients together")):
        if getattr(optimizer, attr, None):
            raise UnsupportedError(f"ShardedOptimizer: {attr}= {why}, which a rank holding "
                                   "slices cannot compute; use clipvalue= or "
                                   "DistributedOptimizer")
    if getattr(optimizer, "use_ema", False):
        raise UnsupportedError("ShardedOptimizer: use_ema=True keeps whole copies of the "
                               "variables; not supported")
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_names", None):
        raise UnsupportedError("ShardedOptimizer: exclude_from_weight_decay picks variables "
                               "by name, and the shards mix variables; not supported")
    if getattr(optimizer, "built", False):
        raise UnsupportedError("ShardedOptimizer needs an optimizer that has not stepped "
                               "yet (its state would be whole); wrap it before compile()")


def ShardedOptimizer(optimizer: Any, name: str | None = None, stage: int = 1,
                     backward_passes_per_step: int = 1,
                     average_aggregated_gradients: bool = False,
                     compression: Compresses | None = None, op: Any = ReduceOp.AVERAGE,
                     process_set: ProcessSet = global_process_set,
                     elementwise: bool | None = None) -> Any:
    """Wrap a Keras 3 optimizer so that each rank keeps ``1/N`` of its state and every
    step applies gradients averaged over the ranks: ``DistributedOptimizer``'s update in
    less memory. Every rank must wrap it and build it (``compile``/``fit`` or the first
    ``apply_gradients``) with the same variables.

    Args:
        optimizer: a Keras 3 optimizer that has not stepped, whose update is elementwise
            (SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion).
        name: prefix of the collectives' names (default: the optimizer's name).
        stage: 1 or 2: the optimizer's state sharded, and the accumulated gradients of
            ``backward_passes_per_step`` at both (module docstring).
        backward_passes_per_step: batches accumulated per update (module docstring).
        average_aggregated_gradients: average the accumulated passes (Keras'
            convention) instead of summing them (Horovod's default).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16`` on the wire.
        op: ``Average`` only.
        process_set: the ranks that shard (default: all); outside it, a plain optimizer.
        elementwise: True to vouch for an optimizer ronde does not know; False refuses.

    Raises:
        UnsupportedError: see the module docstring.
    """
    if stage not in (1, 2):
        raise ValueError(f"ShardedOptimizer: stage must be 1 or 2, got {stage!r}")
    if _api.resolve_op(op, None) != ReduceOp.AVERAGE:
        raise UnsupportedError("ShardedOptimizer averages gradients: op=Adasum and op=Sum are "
                               "not supported (use DistributedOptimizer(op=hvd.Adasum))")
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    _check(optimizer, elementwise)
    if int(getattr(optimizer, "gradient_accumulation_steps", None) or 1) > 1:
        raise ValueError("ShardedOptimizer: set backward_passes_per_step instead of the "
                         "optimizer's gradient_accumulation_steps")
    config = optimizer.get_config()
    wrapped = sharded_class(type(optimizer)).from_config(config)
    _keep(wrapped, "_ronde_cfg", {
        "base": type(optimizer), "inner_config": config, "process_set": process_set,
        "prefix": name or f"ShardedOptimizer.{optimizer_name(optimizer)}",
        "passes": passes, "average_aggregated": bool(average_aggregated_gradients),
        "wire_dtype": wire_dtype_of(compression), "stage": int(stage)})
    return wrapped


def is_sharded(optimizer: Any) -> bool:
    """True for an optimizer returned by :func:`ShardedOptimizer`."""
    return isinstance(optimizer, _ShardedMixin)
