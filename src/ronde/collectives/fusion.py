"""Tensor fusion: pack many tensors into one buffer, reduce once, unpack.

Where it sits in the engine cycle: negotiation has already grouped compatible
allreduces (same process set, dtype, op and scale factors) up to
``RONDE_FUSION_THRESHOLD`` bytes; the executor asks the communicator for a staging
buffer (shared memory on the shm transport, so packing *is* the copy into the
segment) or falls back to a private, reused fusion buffer, then calls
:func:`pack` and :func:`unpack`. Scale factors are applied during these copies
(``np.multiply(..., out=)`` costs the same as a copy), never as an extra pass.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .ops import scale_inplace, scaled_copy  # noqa: F401 - used by the executor as fusion.*


class FusionBuffer:
    """A private byte buffer that grows to the largest fused size seen, then is reused."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.nbytes), dtype=np.uint8)
        return self._buf[:nbytes]


def pack(flat: np.ndarray, inputs: Sequence[np.ndarray | None], sizes: Sequence[int],
         factor: float) -> None:
    """Copy each input (flattened) into consecutive slices of ``flat``; None packs zeros."""
    off = 0
    for arr, n in zip(inputs, sizes):
        dst = flat[off: off + n]
        if arr is None:
            dst.fill(0)
        else:
            scaled_copy(dst, arr.reshape(-1), factor)
        off += n


def unpack_pieces(pieces: Sequence[tuple[int, np.ndarray]],
                  outputs: Sequence[np.ndarray | None], sizes: Sequence[int],
                  factor: float) -> None:
    """Like :func:`unpack`, from a result held as ``(offset, view)`` pieces (e.g. one
    block per rank's shared segment), so no gather into one buffer is needed."""
    if len(pieces) == 1:
        unpack(pieces[0][1], outputs, sizes, factor)
        return
    off = 0
    for out, n in zip(outputs, sizes):
        if out is not None and n:
            dst = out.reshape(-1)
            for start, view in pieces:
                lo, hi = max(off, start), min(off + n, start + view.size)
                if lo < hi:
                    scaled_copy(dst[lo - off: hi - off], view[lo - start: hi - start], factor)
        off += n


def unpack(flat: np.ndarray, outputs: Sequence[np.ndarray | None], sizes: Sequence[int],
           factor: float) -> None:
    """Copy consecutive slices of ``flat`` back into each output (None: skip)."""
    off = 0
    for out, n in zip(outputs, sizes):
        if out is not None:
            scaled_copy(out.reshape(-1), flat[off: off + n], factor)
        off += n
