"""ronde: distributed data-parallel training in pure Python, with Horovod's API.

Typical use (numpy arrays; framework bindings such as ``ronde.torch`` build on this)::

    import ronde as hvd
    hvd.init()
    avg = hvd.allreduce(local_gradient)          # averaged over all ranks
    hvd.broadcast(params, root_rank=0)

Launch with ``ronderun -np 4 python train.py``. Importing ronde imports no deep
learning framework and no MPI.
"""

from ._errors import (AuthenticationError, ConfigError, DuplicateNameError, JoinedError,
                      NotInitializedError, PeerLostError, ProtocolError, RendezvousError,
                      RondeError, SecurityError, ShutdownError, StallError,
                      TensorMismatchError, ArgumentError, CollectiveError, DeadlockError,
                      HorovodInternalError, HostsUpdatedInterrupt, ProcessSetError,
                      UnsupportedError)
from ._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .process_sets import ProcessSet, global_process_set

__version__ = "0.1.0"

# The API module (numpy, the engine) is imported on first use, so that
# ``import ronde`` costs about a millisecond and imports no framework.
_LAZY = {name: "._api" for name in ['GroupHandle', 'add_process_set', 'allgather', 'allgather_async', 'allreduce', 'allreduce_async', 'alltoall', 'alltoall_async', 'barrier', 'broadcast', 'broadcast_async', 'cross_rank', 'cross_size', 'init', 'is_homogeneous', 'is_initialized', 'join', 'local_rank', 'local_size', 'poll', 'rank', 'reducescatter', 'reducescatter_async', 'remove_process_set', 'shutdown', 'size', 'synchronize', 'active_transport', 'start_timeline', 'stop_timeline']}
_LAZY.update({name: "._grouped" for name in [
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allgather",
    "grouped_allgather_async", "grouped_reducescatter", "grouped_reducescatter_async"]})
_LAZY.update({name: "._build" for name in [
    "ccl_built", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built", "gpu_available"]})
_LAZY.update({name: "._objects" for name in ["allgather_object", "broadcast_object"]})
_LAZY["Handle"] = ".core.requests"
_LAZY["save_checkpoint"] = ".checkpoint"


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ronde' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

from ._facade import FACADES as _FACADES  # noqa: E402

__all__ = list(_FACADES["ronde"])
