"""Small helpers of Horovod's that its test suites and examples import.

``horovod.common.util`` and ``horovod.runner.common.util.env`` resolve here under the
:mod:`ronde.compat` alias. Each function does what Horovod documents for it, written
anew; nothing here is used by ronde itself.
"""

from __future__ import annotations

import os
from typing import Any, Sequence


def get_env_rank_and_size() -> tuple[int, int]:
    """This process's (rank, size) from the launcher's variables, or (0, 1) outside a job.

    Read, in this order: ``HOROVOD_RANK``/``HOROVOD_SIZE`` (set by ronderun too), Open MPI's
    ``OMPI_COMM_WORLD_*``, then ``PMI_RANK``/``PMI_SIZE``.
    """
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"cannot tell this process's rank and size: only one of "
                               f"{rank_var} and {size_var} is set")
    return 0, 1


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """True when version string ``ver`` >= ``target`` (both strings, as Horovod requires)."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"expected two version strings, got {ver!r} and {target!r}")
    from packaging import version

    return version.parse(ver) >= version.parse(target)


def split_list(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    """``items`` in ``n`` consecutive chunks whose lengths differ by at most one."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Horovod checks that its compiled extension exists; ronde has none to check."""


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether the framework sees a CUDA GPU (``ext_base_name``: 'torch', 'tensorflow')."""
    if "torch" in ext_base_name:
        import torch

        return bool(torch.cuda.is_available())
    if "tensorflow" in ext_base_name:
        import tensorflow as tf

        return bool(tf.config.list_physical_devices("GPU"))
    return False
