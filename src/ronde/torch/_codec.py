"""How torch's optimizer state travels: the codec of the sharded checkpoints' files
(:mod:`ronde.frameworks.sharded_files`), of the elastic reshard's messages
(:mod:`ronde.frameworks.reshard`) and of the in-job export
(:func:`ronde.frameworks.sharded_files.gather`): tensors stay tensors (bfloat16
included), moved by torch's collectives and files."""

from __future__ import annotations

import io
from typing import IO, Any, Sequence

import numpy as np
import torch

from ..frameworks import sharded_files
from ..process_sets import ProcessSet
from . import _collectives as C


class TorchCodec(sharded_files.Codec):
    """Torch's pieces: a slot is a tensor of one dimension or more (any dtype, bfloat16
    included), a scalar anything else (Adam's ``step``). In a step's files each rank's
    ``{"pieces": [(name, a, b)], "state": [each piece's state]}`` and ``meta.pt``; in the
    elastic reshard's messages the pieces as they are; all written with ``torch.save``
    and read back with ``torch.load(weights_only=True)``."""

    suffix = ".pt"
    meta = "meta.pt"

    def entry(self, key: str, a: int, b: int, state: dict[str, Any]) -> Any:
        return (key, a, b)

    def write(self, fh: IO[bytes], pieces: Sequence[sharded_files.Piece]) -> None:
        torch.save({"pieces": [(key, a, b) for key, a, b, _ in pieces],
                    "state": [state for _, _, _, state in pieces]}, fh)

    def read(self, fh: IO[bytes], entries: list[Any], needed: list[int]
             ) -> dict[int, dict[str, Any]]:
        state = torch.load(fh, weights_only=True)["state"]
        return {j: state[j] for j in needed}

    def write_meta(self, fh: IO[bytes], meta: dict[str, Any]) -> None:
        torch.save(meta, fh)

    def read_meta(self, data: bytes, where: str) -> Any:
        return torch.load(io.BytesIO(data), weights_only=True)

    def encode(self, pieces: list[Any]) -> np.ndarray:
        buf = io.BytesIO()
        torch.save(pieces, buf)
        return np.frombuffer(buf.getvalue(), dtype=np.uint8)

    def decode(self, data: np.ndarray) -> list[Any]:
        return torch.load(io.BytesIO(data.tobytes()), weights_only=True)

    def is_array(self, value: Any) -> bool:
        return torch.is_tensor(value) and value.dim() > 0

    def zeros(self, like: Any, n: int) -> Any:
        return torch.zeros(n, dtype=like.dtype)

    def copy(self, value: Any) -> Any:
        return value.clone() if torch.is_tensor(value) else value

    def describe(self, value: Any) -> tuple[str, Any]:
        if self.is_array(value):
            return "array", _name(value.dtype)
        if torch.is_tensor(value):  # a 0-dim tensor (Adam's step): kept with its dtype
            return "scalar", (value.item(), _name(value.dtype))
        return "scalar", (value, None)

    def scalar(self, described: Any) -> Any:
        value, dtype = described
        return value if dtype is None else torch.tensor(value, dtype=getattr(torch, dtype))

    def flat(self, value: Any, dtype: str | None = None) -> Any:
        if value is None:
            return torch.empty(0, dtype=getattr(torch, dtype))
        return value.detach().reshape(-1)

    def gather_one(self, send: Any, root: int | None, name: str,
                   process_set: ProcessSet) -> Any:
        if root is None:
            return C.allgather_async(send, name, process_set).wait()
        splits = [0] * C.set_size(process_set)
        splits[root] = send.numel()
        return C.alltoall_async(send, splits, name, process_set).wait()[0]


TORCH = TorchCodec()


def _name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32`` (any dtype: the state's are the optimizer's)."""
    return str(dtype).replace("torch.", "")
