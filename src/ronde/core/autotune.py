"""Autotune: rank 0 tunes the fusion threshold, the cycle time, the inline limit and the
spin time online from the bytes reduced per second; every rank applies the same values
at the same negotiation round.

Where it sits in the engine cycle: after each round, rank 0's :class:`Tuner` counts
the bytes of the agreed collectives (``observe``). A *step* ends when a tensor name is
seen again (training repeats its gradient names every step); a *sample* is
``RONDE_AUTOTUNE_STEPS_PER_SAMPLE`` steps, scored as the median over its steps of
(bytes of the step / its wall time): bytes per second, higher is better, and for a
fixed model proportional to steps per second. The first
``RONDE_AUTOTUNE_WARMUP_SAMPLES`` samples are discarded. When a sample ends with new
values to try, rank 0 puts them in its next round message
(:class:`~.protocol.Tuning`); every rank, rank 0 included, applies them after that
round's responses are decided (:func:`apply`), so every rank plans every round with
the same fusion threshold: the values are decided by one rank and agreed through the
negotiation itself, as Horovod's coordinator does.

The search (Horovod's parameter manager, rewritten):

1. Fusion threshold (0-64 MiB) and cycle time (0.2-20 ms) together by Bayesian
   optimisation (``bayes.py``): the configured values first (so the log shows what the
   defaults score), three spread test points, then expected improvement, up to
   ``RONDE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` samples in all.
2. Then, at the best of those, each of ``RONDE_INLINE_BYTES`` (configured, 0, 32 KiB)
   and ``RONDE_SPIN_TIME`` (configured, a quarter, 5x; only when spinning is on) one
   sample per alternative.
3. The best values seen are applied for the rest of the job, and rank 0 logs them as
   the settings to keep.

A knob set explicitly (its ``RONDE_*`` variable, its Horovod fallback or a
``ronderun`` flag) is left alone. ``RONDE_AUTOTUNE_LOG`` gets a CSV row per sample
(warm-up samples included, marked) and the best row last.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import time
from typing import Callable, Iterable

import numpy as np

from .._config import Config
from .bayes import BayesianOptimizer
from .protocol import Tuning
from .requests import Kind
from .responses import Response, any_meta

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: the Bayesian search's ranges: fusion threshold in MiB, cycle time in ms
FUSION_RANGE_MB = (0.0, 64.0)
CYCLE_RANGE_MS = (0.2, 20.0)
#: spread test points after the configured values (fusion MiB, cycle ms)
TEST_POINTS = ((8.0, 0.5), (32.0, 5.0), (2.0, 2.0))
INLINE_CHOICES = (0, 32768)
#: the Bayesian axes: (low, high, field units per axis unit)
_AXES = {"fusion_threshold_bytes": (*FUSION_RANGE_MB, MIB),
         "cycle_time_ms": (*CYCLE_RANGE_MS, 1.0)}
CSV_HEADER = ("sample", "phase", "fusion_threshold_bytes", "cycle_time_ms", "inline_bytes",
              "spin_time_us", "score_bytes_per_s")
#: the knobs the tuner may change, by Config field
TUNABLE = ("fusion_threshold_bytes", "cycle_time_ms", "inline_bytes", "spin_time_us")


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the tuner itself runs (``RONDE_AUTOTUNE_*``)."""

    warmup_samples: int = 3
    steps_per_sample: int = 10
    max_samples: int = 20
    noise: float = 0.8
    log_path: str = ""

    @classmethod
    def from_config(cls, cfg: Config) -> "Settings":
        return cls(cfg.autotune_warmup_samples, cfg.autotune_steps_per_sample,
                   cfg.autotune_bayes_opt_max_samples, cfg.autotune_gaussian_process_noise,
                   cfg.autotune_log)


def search_steps(cfg: Config) -> int:
    """Training steps a whole search takes with these settings (the documented length:
    warm-up, Bayesian and 4 alternative samples of ``steps_per_sample + 1`` steps), plus
    a little slack."""
    return (cfg.autotune_warmup_samples + cfg.autotune_bayes_opt_max_samples + 4) * (
        cfg.autotune_steps_per_sample + 1) + 10


def start_values(cfg: Config) -> Tuning:
    return Tuning(cfg.fusion_threshold_bytes, cfg.cycle_time_ms, cfg.inline_bytes,
                  cfg.spin_time_us)


class Tuner:
    """The search of one job (rank 0); pure apart from the clock and the CSV file.

    ``observe(names, nbytes)`` after each round; it returns the values to distribute
    when they change, else None.
    """

    def __init__(self, settings: Settings, start: Tuning, fixed: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.fixed = frozenset(fixed)
        self.current = start
        self.samples: list[tuple[Tuning, float]] = []
        self.done = False
        self._dims = [d for d in ("fusion_threshold_bytes", "cycle_time_ms")
                      if d not in self.fixed]
        self._bayes = BayesianOptimizer(len(self._dims), settings.noise) if self._dims else None
        self._plan: list[Tuning] = []  # values queued to try, in order
        self._phase = "bayes" if self._dims else "choices"
        self._choice_plan = [] if self._dims else self._choices(start)
        self._warmups = settings.warmup_samples
        self._best: tuple[Tuning, float] | None = None
        self._counts: dict[str, int] = {}
        self._steps = 0
        self._step_bytes = 0
        self._step_start = clock()
        self._rates: list[float] = []
        self._sample_index = 0
        self._file = None
        if settings.log_path:
            self._file = open(settings.log_path, "w", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file)
            self._writer.writerow(CSV_HEADER)
            self._file.flush()
        if self._bayes is not None:  # the start values run first, then the test points
            self._plan = [self._with_point(self._point(Tuning(int(mb * MIB), ms, 0, 0)))
                          for mb, ms in TEST_POINTS]
        log.info("autotune: tuning %s (fixed: %s); score = bytes reduced per second, higher "
                 "is better", ", ".join(t for t in TUNABLE if t not in self.fixed) or "nothing",
                 ", ".join(sorted(self.fixed)) or "none")

    # -- the knob space <-> the unit cube ------------------------------------------
    def _point(self, t: Tuning) -> np.ndarray:
        out = []
        for d in self._dims:
            lo, hi, scale = _AXES[d]
            value = getattr(t, d) / scale
            out.append((min(max(value, lo), hi) - lo) / (hi - lo))
        return np.asarray(out)

    def _with_point(self, x: np.ndarray) -> Tuning:
        t = self.current
        for d, v in zip(self._dims, x):
            lo, hi, scale = _AXES[d]
            value = lo + float(v) * (hi - lo)
            if d == "fusion_threshold_bytes":  # whole quarter MiBs
                t = t._replace(fusion_threshold_bytes=int(round(value * 4)) * MIB // 4)
            else:
                t = t._replace(cycle_time_ms=round(value, 3))
        return t

    # -- measuring ---------------------------------------------------------------------
    def observe(self, names: Iterable[str], nbytes: int) -> Tuning | None:
        """One round's agreed collectives; the values to distribute, if they change."""
        if self.done:
            return None
        counts = self._counts
        new_step = False
        for name in names:
            seen = counts.get(name, 0)
            counts[name] = seen + 1
            if seen > self._steps:
                new_step = True
        out = None
        if new_step:
            now = self.clock()
            elapsed = now - self._step_start
            if elapsed > 0 and self._step_bytes > 0:
                self._rates.append(self._step_bytes / elapsed)
            self._steps += 1
            self._step_bytes = 0
            self._step_start = now
            if len(self._rates) >= self.settings.steps_per_sample:
                out = self._sample_done(float(np.median(self._rates)))
        self._step_bytes += nbytes
        return out

    def _restart_counts(self) -> None:
        self._counts = {}
        self._steps = 0
        self._rates = []

    def _sample_done(self, score: float) -> Tuning | None:
        self._restart_counts()
        if self._warmups > 0:
            self._warmups -= 1
            self._log_row("warmup", self.current, score)
            return None
        self._log_row(self._phase, self.current, score)
        self.samples.append((self.current, score))
        if self._best is None or score > self._best[1]:
            self._best = (self.current, score)
        if self._phase == "bayes":
            assert self._bayes is not None
            self._bayes.add(self._point(self.current), score)
            bayes_left = self.settings.max_samples - len(self._bayes.ys)
            if bayes_left > 0:
                nxt = self._plan.pop(0) if self._plan else self._with_point(self._bayes.suggest())
                return self._switch(nxt)
            self._phase = "choices"
            self._choice_plan = self._choices(self._best[0])
        if self._choice_plan:
            field, value = self._choice_plan.pop(0)
            assert self._best is not None
            return self._switch(self._best[0]._replace(**{field: value}))
        return self._finish()

    def _choices(self, base: Tuning) -> list[tuple[str, float]]:
        """The alternatives of phase 2, as (field, value), each tried on the best so far."""
        out: list[tuple[str, float]] = []
        if "inline_bytes" not in self.fixed:
            out += [("inline_bytes", v) for v in INLINE_CHOICES if v != base.inline_bytes]
        if "spin_time_us" not in self.fixed and base.spin_time_us > 0:
            out += [("spin_time_us", base.spin_time_us / 4), ("spin_time_us",
                                                              base.spin_time_us * 5)]
        return out

    def _switch(self, values: Tuning) -> Tuning | None:
        changed = values != self.current
        self.current = values
        self._step_start = self.clock()
        self._step_bytes = 0
        return values if changed else None

    def _finish(self) -> Tuning | None:
        assert self._best is not None
        best, score = self._best
        self.done = True
        self._log_row("best", best, score)
        if self._file is not None:
            self._file.close()
            self._file = None
        default_score = self.samples[0][1] if self.samples else score
        log.warning(
            "autotune: done after %d samples; keep RONDE_FUSION_THRESHOLD=%d "
            "RONDE_CYCLE_TIME=%g RONDE_INLINE_BYTES=%d RONDE_SPIN_TIME=%g (score %.4g MB/s, "
            "higher is better; the configured values scored %.4g MB/s)",
            len(self.samples), best.fusion_threshold_bytes, best.cycle_time_ms,
            best.inline_bytes, best.spin_time_us, score / 1e6, default_score / 1e6)
        changed = best != self.current
        self.current = best
        return best if changed else None

    def _log_row(self, phase: str, t: Tuning, score: float) -> None:
        self._sample_index += 1
        row = ["best" if phase == "best" else self._sample_index, phase,
               t.fusion_threshold_bytes, t.cycle_time_ms, t.inline_bytes, t.spin_time_us,
               round(score, 1)]
        if phase != "best":
            log.info("autotune: sample %s (%s): %s -> %.4g MB/s", row[0], phase,
                     _describe(t), score / 1e6)
        if self._file is not None:
            self._writer.writerow(row)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _describe(t: Tuning) -> str:
    return (f"fusion {t.fusion_threshold_bytes / MIB:g} MiB, cycle {t.cycle_time_ms:g} ms, "
            f"inline {t.inline_bytes} B, spin {t.spin_time_us:g} us")


def response_bytes(responses: Iterable[Response]) -> tuple[list[str], int]:
    """The names and the bytes of a round's successful data-moving responses."""
    names: list[str] = []
    total = 0
    for resp in responses:
        if resp.error is not None or resp.kind in (Kind.BARRIER, Kind.JOIN):
            continue
        names.extend(resp.names)
        if resp.nbytes >= 0:
            total += resp.nbytes
        else:
            total += sum(any_meta(m).nbytes for m in resp.metas if m)
    return names, total


class AutoTune:
    """The engine's side: rank 0 measures and proposes, every rank applies."""

    def __init__(self, tuner: Tuner | None) -> None:
        self.tuner = tuner
        #: values rank 0 will announce in its next round message
        self.outgoing: Tuning | None = None
        #: (round, values) applied on this rank, in order (the same on every rank)
        self.history: list[tuple[int, Tuning]] = []

    def take(self) -> Tuning | None:
        out, self.outgoing = self.outgoing, None
        return out

    def after_round(self, round_no: int, tune: Tuning | None, responses: list[Response],
                    apply: Callable[[Tuning], None]) -> bool:
        """After round ``round_no``: ``apply`` the values it carried (every rank alike),
        and on rank 0 measure its responses; True when rank 0 has new values to
        announce (wake the control thread to send them)."""
        if tune is not None:
            apply(tune)
            self.history.append((round_no, tune))
        if self.tuner is not None and not self.tuner.done and responses:
            names, nbytes = response_bytes(responses)
            if names:
                proposal = self.tuner.observe(names, nbytes)
                if proposal is not None:
                    self.outgoing = proposal
                    return True
        return False

    def close(self) -> None:
        if self.tuner is not None:
            self.tuner.close()


def for_config(cfg: Config, explicit: Iterable[str]) -> AutoTune:
    """Rank 0's autotuner for this configuration (``explicit``: the fields set by hand)."""
    fixed = set(explicit) & set(TUNABLE)
    if cfg.spin_time_us <= 0:
        fixed.add("spin_time_us")  # callers do not drive at all: nothing to tune
    return AutoTune(Tuner(Settings.from_config(cfg), start_values(cfg), fixed))
