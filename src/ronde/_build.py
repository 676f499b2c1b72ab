"""Build facts, as Horovod reports them: what this installation can use, and uses.

``mpi_built()`` and friends answer from what is importable here; the ``*_enabled()``
ones from the running job's transport.
"""

from __future__ import annotations

from . import _state


def _transport() -> str | None:
    rt = _state.current()
    return None if rt is None else rt.transport


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def mpi_built() -> bool:
    """True when mpi4py is installed, so ``RONDE_TRANSPORT=mpi`` can work."""
    return _importable("mpi4py")


def mpi_enabled() -> bool:
    """True when the global process set moves its bytes through MPI."""
    return _transport() == "mpi"


def gloo_built() -> bool:
    """True when torch.distributed (Gloo) is installed: ``RONDE_TRANSPORT=gloo``."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return bool(dist.is_available())


def gloo_enabled() -> bool:
    """True when the global process set moves its bytes through Gloo."""
    return _transport() == "gloo"


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's ``gpu_available('tensorflow' | 'torch' | 'mxnet')``: whether that
    framework sees a GPU here."""
    name = str(ext_base_name).rsplit(".", 1)[-1]
    try:
        if name == "tensorflow":
            import tensorflow as tf

            return bool(tf.config.list_physical_devices("GPU"))
        if name == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if name == "mxnet":
            import mxnet as mx

            return mx.context.num_gpus() > 0
    except Exception:  # noqa: BLE001 - a framework that cannot say has no GPU for us
        return False
    return False


def nccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """True when MPI runs with ``MPI_THREAD_MULTIPLE`` (only meaningful with mpi)."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
