"""Numbers for the benchmark: size parsing, order statistics, bandwidths.

Pure functions, shared by the workers (which summarise their timings) and the driver
(which combines rounds and prints the table).
"""

from __future__ import annotations

import re
from typing import Sequence

#: The default message sizes, in bytes: 4 B, 64 B, 1 KiB, 16 KiB, 256 KiB, then x4 to 64 MiB.
DEFAULT_SIZES_BYTES: tuple[int, ...] = (4, 64, 1 << 10, 16 << 10, 256 << 10, 1 << 20,
                                        4 << 20, 16 << 20, 64 << 20)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def parse_size_bytes(text: str) -> int:
    """``"4"``, ``"4B"``, ``"16KiB"``, ``"64MiB"`` -> bytes (K/M/G are powers of 1024)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}; write a byte count such as 4B, 16KiB or 64MiB")
    return int(m.group(1)) * _UNITS[unit]


def parse_sizes(text: str) -> list[int]:
    """Parse ``--sizes``: a comma list (``4B,1KiB``) or a range ``A..B`` (powers of 4 from A).

    Every size must be a positive multiple of 4 bytes (the buffers are float32).
    """
    if ".." in text:
        lo_text, hi_text = text.split("..", 1)
        lo, hi = parse_size_bytes(lo_text), parse_size_bytes(hi_text)
        if lo <= 0 or hi < lo:
            raise ValueError(f"bad size range {text!r}; write LOW..HIGH with 0 < LOW <= HIGH")
        sizes = []
        s = lo
        while s <= hi:
            sizes.append(s)
            s *= 4
    else:
        sizes = [parse_size_bytes(part) for part in text.split(",") if part.strip()]
    bad = [s for s in sizes if s <= 0 or s % 4]
    if not sizes or bad:
        raise ValueError(f"sizes {text!r}: every size must be a positive multiple of 4 bytes "
                         "(float32 buffers)")
    return sizes


def format_bytes(n: int) -> str:
    """``4`` -> ``"4 B"``, ``16384`` -> ``"16 KiB"``, ``67108864`` -> ``"64 MiB"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    """The median (the mean of the two middle values for an even count)."""
    return percentile(values, 50.0)


def algbw_GBps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth: bytes of the buffer over the time, in GB/s (1e9 bytes/s)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def bus_factor(case: str, np_: int) -> float:
    """busbw / algbw as nccl-tests defines it: 2(n-1)/n for allreduce (and the fusion
    case, a set of allreduces), (n-1)/n for allgather, reducescatter and alltoall, 1 for
    broadcast (and for a single rank)."""
    if np_ <= 1 or case == "broadcast":
        return 1.0
    if case in ("allgather", "reducescatter", "alltoall"):
        return (np_ - 1) / np_
    return 2 * (np_ - 1) / np_


def busbw_GBps(nbytes: int, seconds: float, np_: int, case: str = "allreduce") -> float:
    """Bus bandwidth as nccl-tests defines it: algbw * :func:`bus_factor`."""
    return algbw_GBps(nbytes, seconds) * bus_factor(case, np_)
