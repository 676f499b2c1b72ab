"""The public names of every facade module, declared once.

Each user-facing module (``ronde``, ``ronde.torch``, ``ronde.tensorflow``,
``ronde.tensorflow.keras``, ``ronde.keras``, ``ronde.jax``, ``ronde.mxnet``) sets its
``__all__`` from :data:`FACADES` and takes the names every binding shares (lifecycle,
topology, process sets, ops, errors, build facts) with :func:`export_common`, instead of
five copies of the same import lists. ``tests/test_facades.py`` checks that every
declared name exists in its module (where the framework is installed), and
docs/compat.md's table of Horovod's API against ronde is built from these lists
(``python -m ronde.compat --table``), so neither can drift from the code.

Importing this module imports no framework.
"""

from __future__ import annotations

from typing import Any

#: start, stop, where this process sits in the job
LIFECYCLE = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
             "cross_rank", "cross_size", "is_homogeneous", "active_transport",
             "start_timeline", "stop_timeline"]
PROCESS_SETS = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
OPS = ["Average", "Sum", "Min", "Max", "Product", "Adasum", "ReduceOp"]
#: every deliberate error (``HorovodInternalError`` is Horovod's name for a failed collective)
ERRORS = ["RondeError", "HorovodInternalError", "CollectiveError", "ConfigError",
          "NotInitializedError", "TensorMismatchError", "DuplicateNameError", "PeerLostError",
          "StallError", "DeadlockError", "RendezvousError", "AuthenticationError",
          "SecurityError", "ProtocolError", "ShutdownError", "JoinedError",
          "UnsupportedError", "ProcessSetError", "ArgumentError", "HostsUpdatedInterrupt"]
#: Horovod's build-introspection functions (what this installation can use)
BUILD = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "cuda_built",
         "rocm_built", "ddl_built", "ccl_built", "mpi_threads_supported", "gpu_available"]
#: the names every facade has
COMMON = LIFECYCLE + PROCESS_SETS + OPS + ERRORS + BUILD

FACADES: dict[str, list[str]] = {
    "ronde": COMMON + [
        "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
        "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
        "grouped_reducescatter_async", "allgather", "allgather_async", "broadcast",
        "broadcast_async", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
        "barrier", "join", "broadcast_object", "allgather_object", "poll", "synchronize",
        "Handle", "GroupHandle", "save_checkpoint"],
    "ronde.torch": COMMON + [
        "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
        "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
        "grouped_allreduce_async_", "sparse_allreduce_async",
        "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
        "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
        "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
        "grouped_reducescatter", "grouped_reducescatter_async",
        "poll", "synchronize", "join", "barrier", "broadcast_object", "allgather_object",
        "TorchHandle", "Compression", "Compressor", "DistributedOptimizer",
        "broadcast_parameters", "broadcast_optimizer_state", "broadcast_state", "SyncBatchNorm",
        "TooManyPassesError", "elastic", "save_checkpoint"],
    "ronde.tensorflow": COMMON + [
        "rank_op", "size_op", "local_rank_op", "local_size_op", "process_set_included_op",
        "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
        "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
        "broadcast_object", "broadcast_object_fn", "allgather_object", "broadcast_variables",
        "DistributedGradientTape", "PartialDistributedGradientTape", "DistributedOptimizer",
        "SyncBatchNormalization", "Compression", "Compressor", "callbacks", "keras", "util", "vars_to_refs", "refs_to_vars",
        "broadcast_global_variables", "elastic"],
    "ronde.keras": COMMON + [
        "join", "barrier", "Compression", "allreduce", "allgather", "broadcast",
        "reducescatter", "broadcast_object", "allgather_object", "broadcast_variables",
        "broadcast_model", "DistributedOptimizer", "PartialDistributedOptimizer",
        "is_distributed", "load_model", "save_checkpoint",
        "callbacks", "elastic"],
    "ronde.jax": COMMON + [
        "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
        "allgather", "allgather_async", "broadcast", "broadcast_async", "alltoall",
        "alltoall_async", "reducescatter", "reducescatter_async", "poll", "synchronize",
        "join", "barrier", "broadcast_object", "allgather_object", "JaxHandle",
        "Compression", "Compressor", "DistributedOptimizer", "DistributedState",
        "allreduce_gradients", "reduce_gradients", "broadcast_parameters",
        "broadcast_optimizer_state", "broadcast_variables", "elastic", "save_checkpoint"],
    "ronde.mxnet": COMMON + [
        "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
        "fused_allreduce_", "allgather", "grouped_allgather", "broadcast", "broadcast_",
        "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "broadcast_object", "allgather_object",
        "Compression", "Compressor", "DistributedOptimizer", "DistributedTrainer",
        "broadcast_parameters"],
}
#: ``import ronde.tensorflow.keras as hvd`` is ronde.keras plus TensorFlow's spellings
FACADES["ronde.tensorflow.keras"] = FACADES["ronde.keras"] + []


def export_common(namespace: dict[str, Any]) -> list[str]:
    """Put the :data:`COMMON` names into a facade module's globals; return its ``__all__``.

    Call as ``__all__ = export_common(globals())`` at the top of a facade; the module's
    own names (its collectives, optimizers) are defined or imported after it.
    """
    from . import _api, _build, _errors, _ops, process_sets

    for name in LIFECYCLE + ["add_process_set", "remove_process_set"]:
        namespace.setdefault(name, getattr(_api, name))
    for name in BUILD:
        namespace.setdefault(name, getattr(_build, name))
    for name in ("ProcessSet", "global_process_set"):
        namespace.setdefault(name, getattr(process_sets, name))
    for name in OPS:
        namespace.setdefault(name, getattr(_ops, name))
    for name in ERRORS:
        namespace.setdefault(name, getattr(_errors, name))
    module = namespace["__name__"]
    return list(FACADES[module])
