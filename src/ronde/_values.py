"""What a setting's text may say: the parsers of the knobs' values, their accepted ranges,
and :class:`Knob`, one setting's declaration.

:mod:`ronde._knobs` declares each knob with one of these parsers and, for a number, a
:class:`Range`; a value outside it (NaN and the infinities always are) is a
:class:`~ronde.ConfigError` naming the variable and the range.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import socket
from typing import Callable

from ._errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
}


def parse_bytes(text: str) -> int:
    """Parse ``"67108864"``, ``"64MB"``, ``"64 MiB"`` or ``"1.5g"`` into bytes.

    Every suffix is a power of 1024: ``KB``/``KiB``/``K``, ``MB``/``MiB``/``M``,
    ``GB``/``GiB``/``G`` (``"64MB"`` is 64 MiB, as Horovod users mean it).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m:
        raise ConfigError(f"cannot parse byte size {text!r}; write e.g. 67108864 or 64MB")
    unit = m.group(2).lower()
    if unit in ("kb", "mb", "gb", "k", "m", "g"):
        unit = unit[0] + "ib"
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown size unit {m.group(2)!r} in {text!r}; use B, KB, MB or GB")
    size = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(size):  # hundreds of digits: int() would raise OverflowError
        raise ConfigError(f"byte size {text!r} is too large")
    return int(size)


def parse_auto_bytes(text: str) -> int | None:
    """``auto`` (None: decided at ``init()``) or a byte size (:func:`parse_bytes`) of at
    most 64 GiB."""
    if text.strip().lower() == "auto":
        return None
    size = parse_bytes(text)
    if size > 64 << 30:
        raise ConfigError(f"byte size {text!r} is over 64GiB")
    return size


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean (1/0, true/false), got {text!r}")


def parse_timeline_path(text: str) -> str:
    """A timeline's file; ``DYNAMIC`` (Horovod's word for "no file now, the script calls
    ``start_timeline()`` later") is no file."""
    return "" if text.strip().upper() == "DYNAMIC" else text


def parse_hierarchical(text: str) -> str:
    """``auto``, or a boolean as ``on``/``off``."""
    return "auto" if text.strip().lower() == "auto" else ("on" if parse_bool(text) else "off")


def _number(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else repr(float(n))


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % scale == 0:
            return f"{_number(n / scale)}{unit}"
    return _number(n)


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric knob accepts: from ``low`` (excluded when ``above``) to ``high``.

    Generous, but finite: NaN and the infinities are never inside.
    """

    low: float
    high: float
    above: bool = False  #: ``low`` itself is refused (``> low``)
    size: bool = False   #: bytes, shown as ``64GiB``

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        return (self.low < value if self.above else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        show = _size if self.size else _number
        return f"{'>' if self.above else '>='} {show(self.low)} and <= {show(self.high)}"


def parse_bind_addr(text: str) -> str:
    """An address to listen on (``RONDE_BIND_ADDR``): empty (ronde chooses), an IP
    address (IPv6 with or without brackets), or a host name that resolves now.

    Raises:
        ConfigError: naming the value and the fix, never the resolver's raw error.
    """
    value = text.strip()
    addr = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    if not addr:
        return ""
    try:
        ipaddress.ip_address(addr.split("%", 1)[0])
        return addr
    except ValueError:
        pass
    shown = repr(addr) if len(addr) <= 80 else f"{addr[:60]!r}... ({len(addr)} characters)"
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(f"{shown} is neither an IP address nor a host name that resolves "
                          f"({why}); set it to an address of this machine that the peers "
                          "reach (e.g. 10.0.0.5, or 0.0.0.0 for every interface), or unset "
                          "it") from None
    return addr


@dataclasses.dataclass(frozen=True)
class Knob:
    """One setting: its Config field, its variable, how it is parsed and documented."""

    field: str
    var: str
    parse: Callable[[str], object]
    default: str     #: as the docs show it; its first `value` parses to the field's default
    unit: str
    doc: str
    horovod: tuple[str, ...] = ()  #: Horovod's variables, read when ``var`` is unset
    horovod_shown: str = ""        #: the docs' Horovod column, when not just ``horovod``
    flag: str = ""                 #: the ``ronderun`` flag that sets it (and its metavar)
    flag_note: str = ""
    accepted: Range | None = None  #: every numeric knob has one (a test checks)

    def accepts(self) -> str:
        """``" (accepted: > 0 and <= 60000 milliseconds)"``: the tail of an error message."""
        if self.accepted is None:
            return ""
        unit = "" if self.accepted.size else re.sub(r"\s*\(.*", "", self.unit).replace("`", "")
        return f" (accepted: {self.accepted}{' ' + unit if unit else ''})"

    def check(self, value: object, shown: str) -> None:
        """Raise :class:`ConfigError` unless ``value`` is in the accepted range.

        ``shown`` is how the user wrote it, e.g. ``RONDE_CYCLE_TIME='nan'``.
        """
        if self.accepted is None or value in self.accepted:
            return
        finite = not isinstance(value, float) or math.isfinite(value)
        raise ConfigError(f"{shown} {'is out of range' if finite else 'is not a finite number'}"
                          f"{self.accepts()}")

    def read(self, name: str, raw: str) -> object:
        """``raw``, the value of variable ``name``, parsed and checked.

        Raises:
            ConfigError: naming ``name``, the value and the accepted range.
        """
        try:
            value = self.parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}{self.accepts()}") from None
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a valid {self.parse.__name__}"
                              f"{self.accepts()}") from None
        self.check(value, f"{name}={raw!r}")
        return value
