"""``Compression.none``, ``Compression.fp16``, ``Compression.bf16`` for torch tensors.

The logic (which dtypes are cast, the float16 overflow policy) is framework-neutral
and lives in :mod:`ronde.frameworks.compression`; this module binds it to torch.
Custom compressors in Horovod's style (a class with ``compress(tensor) -> (tensor,
ctx)`` and ``decompress(tensor, ctx) -> tensor`` static methods) are accepted too.
"""

from __future__ import annotations

import torch

from ..frameworks import compression as _neutral
from ..frameworks.compression import CompressionContext, Compressor
from ._tensors import dtype_name, torch_dtype

__all__ = ["Compression", "Compressor", "CompressionContext"]


class _TorchAdapter:
    def dtype_name(self, tensor: torch.Tensor) -> str:
        return dtype_name(tensor.dtype)

    def cast(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor.to(torch_dtype(name))

    def all_finite(self, tensor: torch.Tensor) -> bool:
        return bool(torch.isfinite(tensor).all())


#: the built-in compressors for torch tensors
Compression: _neutral.Compression[torch.Tensor] = _neutral.Compression(_TorchAdapter())
