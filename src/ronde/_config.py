"""The one typed configuration object.

This module is the only reader of ``RONDE_*`` settings (and of the Horovod names
accepted as fallbacks, so a Horovod user's settings keep working), through the knobs
declared in :mod:`ronde._knobs` (``_knob_docs`` generates docs/configuration.md from it).
``ronderun`` flags are written into these variables for the workers. An unknown
``RONDE_*`` variable (a typo) gets a warning that names the closest knob.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from typing import Mapping, TypeVar

from ._errors import ConfigError
from ._knobs import KNOBS, LAUNCHER_VARIABLES
from ._values import parse_bool, parse_bytes  # noqa: F401 - API

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSPORTS = ("auto", "tcp", "shm", "gloo", "mpi")


@dataclasses.dataclass(frozen=True)
class Config:
    """Resolved runtime configuration (see docs/configuration.md)."""

    fusion_threshold_bytes: int = 64 * 1024 * 1024
    bucket_bytes: int = 25 * 1024 * 1024
    first_bucket_bytes: int | None = None  #: None: ``auto`` (``_cores.first_bucket``)
    bucket_views: bool = True
    sharded_in_flight: int = 1
    sharded_flat_params: bool = True
    sharded_trim_heap: bool = True
    steady_lane: bool = True
    cycle_time_ms: float = 1.0
    round_hold_ms: float = 50.0
    cache_capacity: int = 1024
    transport: str = "auto"
    start_timeout_s: float = 30.0
    stop_grace_s: float = 10.0
    peer_timeout_s: float = 10.0
    shutdown_timeout_s: float = 10.0
    stall_check_time_s: float = 60.0
    stall_shutdown_time_s: float = 300.0
    stall_check_enabled: bool = True
    deadlock_time_s: float = 5.0
    timeline_path: str = ""
    timeline_mark_cycles: bool = False
    torchrun_env: bool = True
    bind_addr: str = ""
    open_startup: bool = False
    shm_segment_bytes: int = 64 * 1024 * 1024
    small_allreduce_bytes: int = 64 * 1024
    inline_bytes: int = 4096
    hierarchical: str = "auto"
    cma: bool = True
    hugepages: bool = True
    shm_control: str = "auto"
    coordinator_min: int = 3
    coordinator_tree_min: int = 128
    spin_time_us: float = 200.0
    torch_device_path: str = "auto"
    log_level: str = ""
    elastic_timeout_s: float = 600.0
    reset_limit: int = 0
    elastic_poll_s: float = 1.0
    autotune: bool = False
    autotune_log: str = ""
    autotune_warmup_samples: int = 3
    autotune_steps_per_sample: int = 10
    autotune_bayes_opt_max_samples: int = 20
    autotune_gaussian_process_noise: float = 0.8

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))


def _lookup(env: Mapping[str, str], name: str, fallbacks: tuple[str, ...]) -> tuple[str, str] | None:
    for var in (name, *fallbacks):
        value = env.get(var)
        if value is not None and value != "":
            return var, value
    return None


def _read(env: Mapping[str, str]) -> dict[str, object]:
    """The Config fields set in ``env``, parsed and range-checked (errors name the variable
    actually set: ``HOROVOD_CYCLE_TIME`` when that is the one)."""
    values: dict[str, object] = {}
    for knob in KNOBS:
        found = _lookup(env, knob.var, knob.horovod)
        if found is not None:
            values[knob.field] = knob.read(*found)
    if env.get("HOROVOD_STALL_CHECK_DISABLE") and "stall_check_enabled" not in values:
        values["stall_check_enabled"] = not parse_bool(env["HOROVOD_STALL_CHECK_DISABLE"])
    return values


def load(env: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build the config from the environment, then explicit overrides."""
    env = os.environ if env is None else env
    values = _read(env)
    warn_unknown(env)
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = Config(**values)  # type: ignore[arg-type]
    _validate(cfg)
    return cfg


def check(env: Mapping[str, str]) -> None:
    """Raise the :class:`ConfigError` that ``load(env)`` would raise, if any (no warnings):
    how ``ronderun`` refuses bad worker settings before it starts a worker."""
    _validate(Config(**_read(env)))  # type: ignore[arg-type]


def setting(field: str, env: Mapping[str, str] | None = None) -> object | None:
    """One knob's value from ``env`` (its variable, else a Horovod fallback), read as
    :func:`load` reads it; None when neither is set."""
    env = os.environ if env is None else env
    knob = next(k for k in KNOBS if k.field == field)
    found = _lookup(env, knob.var, knob.horovod)
    return None if found is None else knob.read(*found)


def explicit_fields(env: Mapping[str, str] | None = None) -> set[str]:
    """The Config fields whose variable (or Horovod fallback) is set in ``env``."""
    env = os.environ if env is None else env
    return {k.field for k in KNOBS if _lookup(env, k.var, k.horovod) is not None}


_warned: set[str] = set()


def unknown_variables(env: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """``RONDE_*`` variables that no knob or launcher reads, each with the closest knob."""
    known = {k.var for k in KNOBS} | LAUNCHER_VARIABLES
    out = []
    for var in sorted(v for v in env if v.startswith("RONDE_") and v not in known):
        close = difflib.get_close_matches(var, sorted(known), n=1, cutoff=0.75)
        out.append((var, close[0] if close else None))
    return out


def warn_unknown(env: Mapping[str, str]) -> None:
    """Log one warning per unknown ``RONDE_*`` variable (once per process)."""
    for var, close in unknown_variables(env):
        if var not in _warned:
            _warned.add(var)
            hint = f"; did you mean {close}?" if close else "; see docs/configuration.md"
            log.warning("%s is not a ronde setting and is ignored%s", var, hint)


def _validate(cfg: Config) -> None:
    if cfg.torch_device_path not in ("auto", "always", "never"):
        raise ConfigError(f"RONDE_TORCH_DEVICE_PATH={cfg.torch_device_path!r}: use auto, always "
                          "or never")
    if cfg.transport not in TRANSPORTS:
        raise ConfigError(
            f"RONDE_TRANSPORT={cfg.transport!r} is not one of {', '.join(TRANSPORTS)}")
    for knob in KNOBS:  # values from the environment were checked as they were read
        value = getattr(cfg, knob.field)
        knob.check(value, f"{knob.field}={value!r} ({knob.var})")
    if cfg.log_level and cfg.log_level.upper() not in (
            "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", "TRACE", "FATAL"):
        raise ConfigError(f"RONDE_LOG_LEVEL={cfg.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
