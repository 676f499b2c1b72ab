"""The ``ronde`` command: ``ronde doctor`` tells what works on this machine."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _single_copy_text() -> str:
    """Whether ranks on this host can copy straight between each other's memory."""
    from .transport import vm

    if not vm.supported():
        return "single-copy collectives: no, process_vm_readv is refused here (seccomp?)"
    scope = vm.ptrace_scope()
    if scope in (None, 0):
        return f"single-copy collectives: yes; {_huge_pages_text()}"
    if scope == 1:
        return ("single-copy collectives: yes (Yama ptrace_scope 1: each rank allows its "
                f"peers with prctl(PR_SET_PTRACER)); {_huge_pages_text()}")
    return (f"single-copy collectives: no, Yama ptrace_scope is {scope} (needs "
            "CAP_SYS_PTRACE); collectives copy through shared memory twice")


def _huge_pages_text() -> str:
    """Whether memory that peers read can be moved onto huge pages (RONDE_HUGEPAGES)."""
    from .transport import hugepages

    if hugepages.HugePages(True).active:
        return "huge pages for it: yes (MADV_COLLAPSE)"
    if not hugepages.thp_allowed():
        return "huge pages for it: no, transparent huge pages are off ([never])"
    return "huge pages for it: no, the kernel lacks MADV_COLLAPSE (Linux 6.1+): reads slower"


def doctor() -> int:
    """Print which transports and frameworks are usable here, and why not the others."""
    import numpy as np

    from . import __version__
    from .transport.segments import shm_dir

    lines = [f"ronde {__version__}, Python {platform.python_version()}, numpy {np.__version__},"
             f" {platform.system()} {platform.machine()}"]
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    shm = shm_dir()
    lines.append("transports:")
    lines.append("  tcp     available")
    if x86 and os.access(shm, os.W_OK):
        lines.append(f"  shm     available (segments in {shm}; {_single_copy_text()})")
    else:
        why = "needs x86-64 memory ordering" if not x86 else f"{shm} is not writable"
        lines.append(f"  shm     not available: {why}")
    if _has("torch"):
        lines.append("  gloo    available (torch.distributed; RONDE_TRANSPORT=gloo)")
    else:
        lines.append("  gloo    not available: pip install torch")
    if _has("mpi4py"):
        lines.append("  mpi     available (mpi4py; RONDE_TRANSPORT=mpi under mpirun, or "
                     "ronderun --mpi)")
    else:
        lines.append("  mpi     not available: pip install 'ronde[mpi]' (mpi4py + MPICH)")
    nccl = False
    if _has("torch"):
        try:
            import torch

            nccl = bool(torch.distributed.is_available() and torch.distributed.is_nccl_available()
                        and torch.cuda.is_available())
        except Exception:  # noqa: BLE001 - a broken torch is reported as unavailable
            nccl = False
    if nccl:
        lines.append("  nccl    available (CUDA tensors in ronde.torch stay on the GPU)")
    else:
        lines.append("  nccl    not available: needs a CUDA build of torch and a GPU "
                     "(CUDA tensors then stay on the GPU)")
    lines.append("frameworks:")
    for name, module in (("PyTorch", "torch"), ("TensorFlow", "tensorflow"), ("Keras", "keras"),
                         ("JAX", "jax"), ("MXNet", "mxnet"), ("mpi4py", "mpi4py"),
                         ("bfloat16 (ml_dtypes)", "ml_dtypes")):
        lines.append(f"  {name:22s}{'installed' if _has(module) else 'not installed'}")
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ronde", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="show what ronde can use on this machine")
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return doctor()
    return 2


if __name__ == "__main__":
    sys.exit(main())
