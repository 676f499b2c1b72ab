"""CUDA tensors stay on the GPU: allreduce and broadcast through a NCCL process group.

ronde's engine still negotiates, orders, fuses and validates every collective (see
:mod:`ronde.core.device`); when the executor reaches an agreed allreduce of CUDA
tensors it calls :class:`TorchDeviceBackend`, which concatenates them into one buffer
on the device (the fusion), reduces it with ``torch.distributed.all_reduce`` on a NCCL
group, applies the scale factors there and copies the pieces back. No byte crosses to
the host.

The process group is created lazily, on every rank at its first device collective:
rank 0 picks a port, :func:`ronde.broadcast_object` gives it to the others, and a
``TCPStore`` at rank 0's address starts ``init_process_group("nccl")``; if
torch.distributed is already initialised (``RONDE_TRANSPORT=gloo``), a NCCL group is
added with ``new_group`` instead.

Other process sets get their own process group, made by the set's members only (at
their first device collective on it; non-members never take part, as ronde's process
sets require): the set's first rank offers a ``TCPStore`` through
``broadcast_object(process_set=...)`` and every member builds a
``ProcessGroupNCCL`` (``ProcessGroupGloo`` for CPU tensors) on it directly, without
touching torch's default group. The other collectives (allgather, alltoall,
reducescatter) take a host round trip for CUDA tensors. ``RONDE_TORCH_DEVICE_PATH=always`` sends CPU tensors through this same path with
Gloo (which is how it is tested on machines without GPUs); ``never`` disables it.

One GPU per rank: NCCL refuses two ranks of a communicator on the same GPU ("Duplicate
GPU detected", since NCCL 2.5). Before a process set's first CUDA collective its members
exchange their GPUs' identities (:func:`_gpu_identity`, through ``allgather_object``);
where two of them share a GPU (a single-GPU workstation running ``-np 2``, or a script
that never pinned ``local_rank``), every member takes the host path for that set's CUDA
tensors instead, and one warning names the ranks and the fix. Every member reaches the
same decision from the same gathered list, so their requests still agree.

Streams: device work runs on the device's default stream, whichever thread runs it (the
control thread, or a caller that drives the engine while it waits). A caller that
submits from a stream of its own (a side stream, a ``with torch.cuda.stream(s)`` block)
has the default stream wait for its stream's work so far (:func:`follow_caller_stream`,
what Horovod's ready events do), and waits for the default stream in turn when it takes
the result (:func:`on_caller_stream`); on the default stream both are a no-op.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
from typing import Any, Iterator, Sequence

import torch

from ..process_sets import ProcessSet
from .. import _api, _objects, _state
from .._ops import ReduceOp
from ..core import device as device_mod
from ..core.requests import Kind
from ..transport import torch_dist
from ._tensors import dtype_name, torch_dtype

logger = logging.getLogger(__name__)


def _mode() -> str:
    rt = _state.current()
    return rt.cfg.torch_device_path if rt is not None else "auto"


def forced() -> bool:
    """Whether CPU tensors take the device path too (``RONDE_TORCH_DEVICE_PATH=always``)."""
    return _mode() == "always"


def wants_device_path(tensor: torch.Tensor, process_set: ProcessSet) -> bool:
    """Whether a collective on ``tensor`` should stay on its device."""
    mode = _mode()
    if mode == "never":
        return False
    if not torch.distributed.is_available():
        return False
    if tensor.is_cuda:
        return torch.distributed.is_nccl_available() and BACKEND.own_gpus(tensor, process_set)
    return mode == "always" and tensor.device.type == "cpu" and not tensor.is_sparse


def prepare(tensors: Sequence[torch.Tensor], process_set: ProcessSet) -> bool:
    """Set up the device path for ``tensors`` now, where the caller is (never in a hook).

    The placement check (every member on a GPU of its own) and the process group's
    creation are collectives over the set; ``DistributedOptimizer`` calls this at
    construction, on every member, so its gradient hooks find both done. Returns
    whether these tensors take the device path.
    """
    sample = next((t for t in tensors if t.is_cuda), tensors[0] if tensors else None)
    if sample is None or not wants_device_path(sample, process_set):
        return False
    BACKEND.ensure(sample, process_set)
    return True


class TorchDeviceBackend:
    """Runs the engine's device collectives with torch.distributed (see module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._group: Any = None
        self._device: torch.device | None = None
        self._generation = -1
        #: process set id -> (its own process group, generation)
        self._sets: dict[int, tuple[Any, int]] = {}
        #: process set id -> (every member on a GPU of its own, generation)
        self._placement: dict[int, tuple[bool, int]] = {}

    def close(self) -> None:
        """Drop every process group (``ronde.shutdown()``, once all ranks are idle)."""
        with self._lock:
            self._group = None
            self._sets.clear()
            self._placement.clear()
            self._generation = -1

    def own_gpus(self, sample: torch.Tensor, process_set: ProcessSet) -> bool:
        """Whether every member of ``process_set`` has a GPU of its own (NCCL's rule).

        Decided once per process set and generation, collectively (see module doc).
        """
        rt = _api.runtime()
        ps_id = getattr(process_set, "process_set_id", None) or 0
        have = self._placement.get(ps_id)
        if have is not None and have[1] == rt.generation:
            return have[0]
        members = (sorted(int(r) for r in process_set.ranks) if ps_id
                   else list(range(rt.topo.size)))
        # named for what it is: a rank whose first collective here is on a CPU tensor
        # while a peer's is on a CUDA one leaves this waiting, and the stall report
        # then names it beside the peer's tensor
        ids = _objects.allgather_object(
            _gpu_identity(sample.device), process_set=process_set,
            name=f"ronde.torch.first_cuda_collective.gpu_check.ps{ps_id}.g{rt.generation}")
        shared = shared_gpus(ids, members)
        if shared and rt.topo.rank == members[0]:
            which = "; ".join(f"ranks {', '.join(map(str, rs))} on {gpu}"
                              for gpu, rs in shared.items())
            logger.warning(
                "ronde.torch: several ranks share one GPU (%s), and NCCL needs a GPU per "
                "rank: CUDA allreduce and broadcast%s go through host memory instead. Pin "
                "one GPU per process with torch.cuda.set_device(hvd.local_rank()) and run "
                "no more processes per host than it has GPUs.", which,
                f" on process set {ps_id}" if ps_id else "")
        self._placement[ps_id] = (not shared, rt.generation)
        return not shared

    # -- set-up (caller's thread, at the first device collective of a generation) ---------
    def ensure(self, sample: torch.Tensor, process_set: ProcessSet | None = None) -> None:
        ps_id = getattr(process_set, "process_set_id", None) or 0
        if ps_id:
            self._ensure_set(sample, process_set, ps_id)
            return
        rt = _api.runtime()
        if self._group is not None and self._generation == rt.generation:
            return
        with self._lock:
            if self._group is not None and self._generation == rt.generation:
                return
            dist = torch.distributed
            backend = "nccl" if sample.is_cuda else "gloo"
            timeout = datetime.timedelta(seconds=max(60.0, rt.cfg.start_timeout_s))
            if dist.is_initialized():
                group = dist.new_group(backend=backend, timeout=timeout)
            else:
                store = store_for(rt, list(range(rt.topo.size)), "ronde.torch.device.store",
                               None, timeout)
                dist.init_process_group(backend, store=store, rank=rt.topo.rank,
                                        world_size=rt.topo.size, timeout=timeout)
                group = dist.group.WORLD
                torch_dist.adopt(self.close, world=True)  # destroyed at ronde.shutdown()
            self._device = sample.device
            self._group = group
            self._generation = rt.generation
            logger.info("ronde.torch: %s tensors reduce through a %s process group",
                        sample.device.type, backend)

    def _ensure_set(self, sample: torch.Tensor, process_set: ProcessSet, ps_id: int) -> None:
        """The members-only process group of a process set (see module doc)."""
        rt = _api.runtime()
        have = self._sets.get(ps_id)
        if have is not None and have[1] == rt.generation:
            return
        with self._lock:
            have = self._sets.get(ps_id)
            if have is not None and have[1] == rt.generation:
                return
            dist = torch.distributed
            members = sorted(int(r) for r in process_set.ranks)
            me = members.index(rt.topo.rank)
            timeout = datetime.timedelta(seconds=max(60.0, rt.cfg.start_timeout_s))
            store = store_for(rt, members, f"ronde.torch.device.store.ps{ps_id}", process_set,
                           timeout)
            store = dist.PrefixStore(f"ronde/ps{ps_id}/g{rt.generation}", store)
            if sample.is_cuda:
                group = dist.ProcessGroupNCCL(store, me, len(members))
            else:
                group = dist.ProcessGroupGloo(store, me, len(members), timeout)
            self._device = self._device or sample.device
            self._sets[ps_id] = (group, rt.generation)
            torch_dist.adopt(self.close)  # dropped at ronde.shutdown(), after a barrier
            logger.info("ronde.torch: process set %d (ranks %s) reduces %s tensors through "
                        "its own %s process group", ps_id, members, sample.device.type,
                        "NCCL" if sample.is_cuda else "Gloo")

    def _all_reduce(self, buf: torch.Tensor, op: ReduceOp, ps_id: int) -> None:
        if not ps_id:
            torch.distributed.all_reduce(buf, op=_OPS[op], group=self._group)
            return
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self._sets[ps_id][0].allreduce([buf], opts).wait()

    def _broadcast(self, buf: torch.Tensor, root: int, members: Sequence[int],
                   ps_id: int) -> None:
        if not ps_id:
            torch.distributed.broadcast(buf, src=root, group=self._group)
            return
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = sorted(members).index(root)
        opts.rootTensor = 0
        self._sets[ps_id][0].broadcast([buf], opts).wait()

    # -- DeviceBackend -----------------------------------------------------------------------
    def allreduce(self, ps_id: int, members: Sequence[int], tensors: Sequence[Any | None],
                  shapes: Sequence[tuple[int, ...]], dtype: str, op: ReduceOp,
                  prescale: float, postscale: float, outs: Sequence[Any | None]) -> list[Any]:
        tdtype = torch_dtype(dtype)
        alone = len(members) == 1  # the reduction of one contributor is itself
        with self._on_device():
            first, out0 = tensors[0], outs[0]
            if (len(tensors) == 1 and first is not None and out0 is not None
                    and out0.is_contiguous() and out0.data_ptr() == first.data_ptr()):
                # one in-place tensor (most of a model's large gradients): reduce it where
                # it lies, no fusion buffer and no copy back
                _scale(out0, prescale)
                if not alone:
                    self._all_reduce(out0, op, ps_id)
                _scale(out0, postscale)
                return [out0]
            parts = [t if t is not None else
                     torch.zeros(tuple(s), dtype=tdtype, device=self._device)
                     for t, s in zip(tensors, shapes)]
            buf = _flatten(parts) if len(parts) > 1 else parts[0].reshape(-1).clone()
            _scale(buf, prescale)
            if not alone:
                self._all_reduce(buf, op, ps_id)
            _scale(buf, postscale)
            views = _unflatten(buf, parts) if len(parts) > 1 else [buf.view(parts[0].shape)]
            results, dst, src = [], [], []
            for view, out in zip(views, outs):
                if out is not None:
                    dst.append(out)
                    src.append(view)
                    view = out
                results.append(view)
            if dst:  # one multi-tensor copy, not one kernel per tensor
                torch._foreach_copy_(dst, src)
        return results

    def broadcast(self, ps_id: int, members: Sequence[int], tensor: Any, root: int,
                  out: Any | None) -> Any:
        with self._on_device():
            if out is not None and out.is_contiguous():
                buf = out
                if out.data_ptr() != tensor.data_ptr():
                    buf.copy_(tensor)
            else:
                buf = tensor.clone()
            if len(members) > 1:
                self._broadcast(buf, root, members, ps_id)
            if out is not None and buf is not out:
                out.copy_(buf)
                return out
        return buf

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        # the thread running a collective is the control thread or any caller that waits
        # (see core/engine.py): be explicit about the device, and work on its default
        # stream whichever thread it is, whatever stream that thread is on (the callers'
        # streams are bridged at submission and at the result, see the module doc)
        if self._device is not None and self._device.type == "cuda":
            with torch.cuda.device(self._device), \
                    torch.cuda.stream(torch.cuda.default_stream(self._device)):
                yield
        else:
            yield


def _gpu_identity(device: torch.device) -> str:
    """What tells this GPU from every other one: its UUID, else host and PCI address."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and str(uuid):
        return f"GPU-{uuid}"
    pci = [getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    where = ("pci %s" % ":".join(map(str, pci)) if None not in pci
             else f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')} #{index}")
    return f"{socket.gethostname()} {where}"


def shared_gpus(ids: Sequence[str], members: Sequence[int]) -> dict[str, list[int]]:
    """GPU identity -> the global ranks on it, for every GPU that more than one is on.

    ``ids[i]`` is the identity reported by ``members[i]``.
    """
    on: dict[str, list[int]] = {}
    for rank, gpu in zip(members, ids):
        on.setdefault(gpu, []).append(int(rank))
    return {gpu: ranks for gpu, ranks in on.items() if len(ranks) > 1}


def _flatten_py(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_py(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    views, off = [], 0
    for t in like:
        n = t.numel()
        views.append(flat[off: off + n].view(t.shape))
        off += n
    return views


# torch's own C++ fusion helpers (what its DDP and Apex use): one call for all the
# tensors instead of two Python-level tensor calls each (161 tensors: 0.15 ms vs 0.4)
_flatten = getattr(torch._C._nn, "flatten_dense_tensors", _flatten_py)
_unflatten = getattr(torch._C._nn, "unflatten_dense_tensors", _unflatten_py)


def _scale(buf: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    # like the host path (core/fusion.scaled_copy): an Average's 1/size divides by size
    inv = 1.0 / factor if factor else 0.0
    whole = inv > 1.0 and inv.is_integer()
    if buf.is_floating_point():
        buf.div_(inv) if whole else buf.mul_(factor)
    else:  # integers: like the host path, scale in float64 and truncate toward zero
        wide = buf.to(torch.float64)
        buf.copy_((wide / inv if whole else wide * factor).to(buf.dtype))


def store_for(rt: Any, members: list[int], name: str, process_set: ProcessSet,
           timeout: datetime.timedelta) -> Any:
    """A ``TCPStore`` for ``members``: the first one serves it on a port the kernel
    picks (no window in which another process could take the port) at its own address,
    and offers that address to the others with ``broadcast_object``."""
    first = rt.topo.rank == members[0]
    offer = store = None
    if first:
        mesh = rt.mesh
        host = str(mesh._peers[rt.topo.rank]["addr"]) if mesh is not None and mesh._peers \
            else "127.0.0.1"
        store = torch_dist.master_store(host, timeout.total_seconds())
        offer = (host, int(store.port))
    addr, port = _objects.broadcast_object(offer, members[0], name=name, process_set=process_set)
    if store is None:
        store = torch.distributed.TCPStore(addr, port, len(members), is_master=False,
                                           timeout=timeout)
    return store


_OPS = {
    ReduceOp.SUM: torch.distributed.ReduceOp.SUM,
    ReduceOp.MIN: torch.distributed.ReduceOp.MIN,
    ReduceOp.MAX: torch.distributed.ReduceOp.MAX,
    ReduceOp.PRODUCT: torch.distributed.ReduceOp.PRODUCT,
} if torch.distributed.is_available() else {}

BACKEND = TorchDeviceBackend()
device_mod.register(BACKEND)


def follow_caller_stream(t: torch.Tensor) -> None:
    """Order the engine's (default) stream after the work the caller's stream holds."""
    if t.is_cuda:
        current = torch.cuda.current_stream(t.device)
        if current.cuda_stream != 0:  # 0: the default stream
            torch.cuda.default_stream(t.device).wait_stream(current)


def on_caller_stream(result: torch.Tensor) -> torch.Tensor:
    """The handle's converter: the caller's stream waits for the engine's before use."""
    if result.is_cuda:
        current = torch.cuda.current_stream(result.device)
        if current.cuda_stream != 0:
            current.wait_stream(torch.cuda.default_stream(result.device))
    return result


def _prepare(tensor: torch.Tensor, process_set: ProcessSet) -> tuple[torch.Tensor, torch.Tensor]:
    """(what is sent, what an in-place call writes): the tensor, detached only if it
    requires grad (gradients do not: like every torch operator call, ``detach`` lets go
    of the GIL, and the engine's thread then runs first, see _tensors), the sent one
    contiguous; the process group made and the caller's stream followed."""
    own = tensor.detach() if tensor.requires_grad else tensor
    t = own if own.is_contiguous() else own.contiguous()
    BACKEND.ensure(t, process_set)
    follow_caller_stream(t)
    return t, own


def submit_allreduce(tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                     prescale: float, postscale: float, process_set: ProcessSet,
                     inplace: bool) -> Any:
    """Submit a device allreduce; returns the runtime handle (result: the torch tensor)."""
    t, own = _prepare(tensor, process_set)
    resolved = _api.resolve_op(op, average)
    return _api.submit(Kind.ALLREDUCE, None, name, process_set, op=resolved,
                       prescale=prescale, postscale=postscale, device=t,
                       device_meta=(dtype_name(t.dtype), tuple(t.shape)),
                       out=own if inplace else None)


def submit_broadcast(tensor: torch.Tensor, root_rank: int, name: str | None,
                     process_set: ProcessSet,
                     inplace: bool) -> Any:
    """Submit a device broadcast; returns the runtime handle (result: the torch tensor)."""
    t, own = _prepare(tensor, process_set)
    return _api.submit(Kind.BROADCAST, None, name, process_set, root=int(root_rank), device=t,
                       device_meta=(dtype_name(t.dtype), tuple(t.shape)),
                       out=own if inplace else None)
