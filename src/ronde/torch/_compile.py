"""``torch.compile`` that keeps communication overlapped with the backward pass.

A model compiled whole runs its backward as one AOTAutograd node: every gradient becomes
ready at its end, every gradient hook (ronde's, like any) fires then, and the
reductions that eager mode starts during the backward all start after it (measured:
docs/benchmarks.md, "Overlap under torch.compile"). DDP avoids this with Dynamo's
``DDPOptimizer``, which splits the captured graph at its bucket boundaries and compiles
each piece separately, so that each piece's backward ends (and its buckets' hooks fire)
while the earlier pieces' backward still runs. Dynamo applies it only to modules inside
DDP's forward; :func:`compile_backend` applies the same splitting with ronde's bucket sizes::

    model = torch.compile(model, backend=hvd.compile_backend())          # inductor
    model = torch.compile(model, backend=hvd.compile_backend("aot_eager"))

The splitting is Dynamo's own (``torch._dynamo.backends.distributed.DDPOptimizer``: a
private class of torch, used here because it is the piece DDP itself relies on; its
absence gives a clear error). The split points follow the gradients' sizes in reverse
graph order, capped at ``RONDE_BUCKET_BYTES`` (the first piece at ronde's first-bucket
size), as :mod:`._buckets` lays out buckets; they need not coincide with ronde's buckets
exactly: any split restores overlap.

:func:`eager` is ``torch.compiler.disable`` for ronde's own optimizer methods without
importing Dynamo when the process never compiles anything (Dynamo's import costs 1.2 s of
CPU, as much as importing torch itself, in every rank of every job).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

from .. import _config, _state
from .._errors import UnsupportedError
from ._buckets import FIRST_BUCKET_BYTES

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """``torch.compiler.disable(fn)``, with Dynamo imported only where it already is.

    A compiled function that calls ``fn`` runs it eagerly (a graph break around it), as
    under ``torch.compiler.disable``. While Dynamo has not been imported nothing can be
    compiling, so ``fn`` is called as it is; the disabled form is made at the first call
    that finds Dynamo imported (compiling a function imports it first), then kept.
    """
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not disabled:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            import torch._dynamo

            disabled.append(torch._dynamo.disable(fn, recursive=True))
        return disabled[0](*args, **kwargs)

    if "torch._dynamo" in sys.modules:  # made now: no first call inside a trace
        import torch._dynamo

        disabled.append(torch._dynamo.disable(fn, recursive=True))
    return call  # type: ignore[return-value]


def compile_backend(backend: str | Callable[..., Any] = "inductor",
                    bucket_bytes: int | None = None) -> Callable[..., Any]:
    """A Dynamo backend that compiles ``backend``'s way, one graph per bucket of
    gradients, so that the reductions overlap the compiled backward pass.

    Args:
        backend: a backend name (``"inductor"``, ``"aot_eager"``...) or a Dynamo
            compiler function.
        bucket_bytes: the split size (default: ``RONDE_BUCKET_BYTES``).

    Raises:
        UnsupportedError: this torch has no ``DDPOptimizer`` to split graphs with.
    """
    try:
        from torch._dynamo.backends.distributed import DDPOptimizer
        from torch._dynamo.backends.registry import lookup_backend
    except ImportError as exc:  # pragma: no cover - every torch 2.x has it
        raise UnsupportedError(f"ronde.torch.compile_backend needs Dynamo's DDPOptimizer, "
                               f"which this torch lacks ({exc}); compile each top-level "
                               "block instead (docs/pytorch.md)") from None
    compile_fn = lookup_backend(backend) if isinstance(backend, str) else backend
    if bucket_bytes is None:
        rt = _state.current()
        bucket_bytes = (rt.cfg if rt is not None else _config.load()).bucket_bytes
    cap = int(bucket_bytes)
    splitter = DDPOptimizer(bucket_bytes_cap=cap, backend_compile_fn=compile_fn,
                            first_bucket_cap=min(FIRST_BUCKET_BYTES, cap))
    return splitter.compile_fn
