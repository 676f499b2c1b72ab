"""The one typed configuration object.

This module is the only reader of ``RONDE_*`` environment variables (and of the
Horovod names accepted as fallbacks, so a Horovod user's settings keep working).
``ronderun`` flags are written into these variables for the workers. Every knob is
listed in ``docs/configuration.md``; keep the two in step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Callable, Mapping, TypeVar

from ._errors import ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")

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
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"expected a boolean (1/0, true/false), got {text!r}")


TRANSPORTS = ("auto", "tcp", "shm", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved runtime configuration (see docs/configuration.md)."""

    fusion_threshold_bytes: int = 64 * 1024 * 1024
    cycle_time_ms: float = 1.0
    cache_capacity: int = 1024
    transport: str = "auto"
    start_timeout_s: float = 30.0
    peer_timeout_s: float = 10.0
    shutdown_timeout_s: float = 10.0
    stall_check_time_s: float = 60.0
    stall_shutdown_time_s: float = 300.0
    stall_check_enabled: bool = True
    deadlock_time_s: float = 5.0
    timeline_path: str = ""
    timeline_mark_cycles: bool = False
    bind_addr: str = ""
    shm_segment_bytes: int = 64 * 1024 * 1024
    small_allreduce_bytes: int = 64 * 1024
    inline_bytes: int = 4096
    hierarchical: str = "auto"
    cma: bool = True
    hugepages: bool = True
    shm_control: bool = True
    spin_time_us: float = 200.0
    torch_device_path: str = "auto"
    log_level: str = ""

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


# field -> (ronde variable, horovod fallbacks, parser)
_ENV: dict[str, tuple[str, tuple[str, ...], Callable[[str], object]]] = {
    "fusion_threshold_bytes": ("RONDE_FUSION_THRESHOLD", ("HOROVOD_FUSION_THRESHOLD",), parse_bytes),
    "cycle_time_ms": ("RONDE_CYCLE_TIME", ("HOROVOD_CYCLE_TIME",), float),
    "cache_capacity": ("RONDE_CACHE_CAPACITY", ("HOROVOD_CACHE_CAPACITY",), int),
    "transport": ("RONDE_TRANSPORT", (), str),
    "start_timeout_s": ("RONDE_START_TIMEOUT", ("HOROVOD_START_TIMEOUT",), float),
    "peer_timeout_s": ("RONDE_PEER_TIMEOUT", (), float),
    "shutdown_timeout_s": ("RONDE_SHUTDOWN_TIMEOUT", (), float),
    "stall_check_time_s": ("RONDE_STALL_CHECK_TIME", ("HOROVOD_STALL_CHECK_TIME_SECONDS",), float),
    "stall_shutdown_time_s": (
        "RONDE_STALL_SHUTDOWN_TIME", ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",), float),
    "stall_check_enabled": (
        "RONDE_STALL_CHECK", (), _parse_bool),
    "deadlock_time_s": ("RONDE_DEADLOCK_TIME", (), float),
    "timeline_path": ("RONDE_TIMELINE", ("HOROVOD_TIMELINE",), str),
    "timeline_mark_cycles": ("RONDE_TIMELINE_MARK_CYCLES", ("HOROVOD_TIMELINE_MARK_CYCLES",),
                             _parse_bool),
    "bind_addr": ("RONDE_BIND_ADDR", (), str),
    "shm_segment_bytes": ("RONDE_SHM_SEGMENT", (), parse_bytes),
    "small_allreduce_bytes": ("RONDE_SMALL_ALLREDUCE", (), parse_bytes),
    "inline_bytes": ("RONDE_INLINE_BYTES", (), parse_bytes),
    "cma": ("RONDE_CMA", (), _parse_bool),
    "hugepages": ("RONDE_HUGEPAGES", (), _parse_bool),
    "shm_control": ("RONDE_SHM_CONTROL", (), _parse_bool),
    "spin_time_us": ("RONDE_SPIN_TIME", (), float),
    "torch_device_path": ("RONDE_TORCH_DEVICE_PATH", (), str),
    "hierarchical": ("RONDE_HIERARCHICAL_ALLREDUCE", ("HOROVOD_HIERARCHICAL_ALLREDUCE",),
                     lambda v: "auto" if v.lower() == "auto" else ("on" if _parse_bool(v) else "off")),
    "log_level": ("RONDE_LOG_LEVEL", ("HOROVOD_LOG_LEVEL",), str),
}


def _lookup(env: Mapping[str, str], name: str, fallbacks: tuple[str, ...]) -> tuple[str, str] | None:
    for var in (name, *fallbacks):
        value = env.get(var)
        if value is not None and value != "":
            return var, value
    return None


def load(env: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build the config from the environment, then explicit overrides."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field, (name, fallbacks, parser) in _ENV.items():
        found = _lookup(env, name, fallbacks)
        if found is None:
            continue
        var, raw = found
        try:
            values[field] = parser(raw)
        except ConfigError as exc:
            raise ConfigError(f"{var}: {exc}") from None
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a valid {parser.__name__}") from None
    if env.get("HOROVOD_STALL_CHECK_DISABLE") and "stall_check_enabled" not in values:
        values["stall_check_enabled"] = not _parse_bool(env["HOROVOD_STALL_CHECK_DISABLE"])
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = Config(**values)  # type: ignore[arg-type]
    _validate(cfg)
    return cfg


def _validate(cfg: Config) -> None:
    if cfg.torch_device_path not in ("auto", "always", "never"):
        raise ConfigError(f"RONDE_TORCH_DEVICE_PATH={cfg.torch_device_path!r}: use auto, always "
                          "or never")
    if cfg.transport not in TRANSPORTS:
        raise ConfigError(
            f"RONDE_TRANSPORT={cfg.transport!r} is not one of {', '.join(TRANSPORTS)}")
    for name in ("cycle_time_ms", "start_timeout_s", "peer_timeout_s", "shutdown_timeout_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(cfg, name)}")
    if cfg.deadlock_time_s < 0:
        raise ConfigError("RONDE_DEADLOCK_TIME must be >= 0 (0: never report crossed collectives)")
    if cfg.spin_time_us < 0:
        raise ConfigError("RONDE_SPIN_TIME must be >= 0 (0: never spin)")
    if cfg.fusion_threshold_bytes < 0:
        raise ConfigError("RONDE_FUSION_THRESHOLD must be >= 0 (0 disables fusion)")
    if cfg.log_level and cfg.log_level.upper() not in (
            "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "TRACE", "FATAL"):
        raise ConfigError(f"RONDE_LOG_LEVEL={cfg.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    if cfg.shm_segment_bytes < 1 << 16:
        raise ConfigError("RONDE_SHM_SEGMENT must be at least 64KiB")
