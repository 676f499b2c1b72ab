"""Autotune (core/autotune.py, core/bayes.py): the search on a synthetic throughput
surface with an injected clock, fixed knobs left alone, the CSV log (2 real ranks:
tests/integration/test_autotune.py)."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from ronde.core import autotune
from ronde.core.protocol import Tuning

MIB = autotune.MIB
START = Tuning(64 * MIB, 1.0, 4096, 200.0)
NAMES = [f"grad.{i}" for i in range(10)]
STEP_BYTES = 10 * MIB


def surface(t: Tuning, peak: tuple[float, float]) -> float:
    """Bytes per second: a smooth hill in (fusion MiB, cycle ms) over a floor; 5 % more
    without inline data."""
    f, c = t.fusion_threshold_bytes / MIB, t.cycle_time_ms
    hill = math.exp(-((f - peak[0]) / 20) ** 2 - ((c - peak[1]) / 6) ** 2)
    return (1e9 * hill + 2e8) * (1.05 if t.inline_bytes == 0 else 1.0)


def drive(tuner: autotune.Tuner, clock: list[float], score, noise: float = 0.0,
          max_steps: int = 5000) -> int:
    """Training steps against the synthetic surface: one round per step, the step
    taking STEP_BYTES / score(current values) of the injected clock."""
    rng = np.random.default_rng(7)
    steps = 0
    while not tuner.done and steps < max_steps:
        tuner.observe(NAMES, STEP_BYTES)
        rate = score(tuner.current) * (1.0 + noise * rng.standard_normal())
        clock[0] += STEP_BYTES / rate
        steps += 1
    return steps


def samples_budget(s: autotune.Settings) -> int:
    """The documented length of a search: warm-up + Bayesian + 4 alternatives (inline
    0 and 32 KiB, spin a quarter and 5x), each sample steps_per_sample steps (+1)."""
    return (s.warmup_samples + s.max_samples + 4) * (s.steps_per_sample + 1)


@pytest.mark.parametrize("peak", [(20.0, 6.0), (50.0, 15.0), (4.0, 1.0), (60.0, 2.0)])
@pytest.mark.parametrize("noise", [0.0, 0.05])
def test_finds_the_peak_within_ten_percent_in_the_documented_samples(peak, noise):
    clock = [0.0]
    settings = autotune.Settings()
    tuner = autotune.Tuner(settings, START, clock=lambda: clock[0])
    steps = drive(tuner, clock, lambda t: surface(t, peak), noise)
    assert tuner.done and steps <= samples_budget(settings), steps
    best = surface(Tuning(int(peak[0] * MIB), peak[1], 0, 200.0), peak)
    assert surface(tuner.current, peak) >= 0.9 * best, tuner.current
    assert tuner.current.inline_bytes == 0  # the better alternative is kept
    assert tuner.samples[0][0] == START  # the configured values are scored first


def test_fixed_knobs_are_left_alone():
    clock = [0.0]
    tuner = autotune.Tuner(autotune.Settings(max_samples=8), START,
                           fixed={"fusion_threshold_bytes", "spin_time_us"},
                           clock=lambda: clock[0])
    seen = set()

    def score(t):
        seen.add((t.fusion_threshold_bytes, t.spin_time_us))
        return surface(t, (20.0, 6.0))

    drive(tuner, clock, score)
    assert tuner.done and seen == {(64 * MIB, 200.0)}
    assert len({t.cycle_time_ms for t, _ in tuner.samples}) > 3  # the free one moves


def test_everything_fixed_tunes_nothing_but_still_finishes():
    clock = [0.0]
    tuner = autotune.Tuner(autotune.Settings(), START, fixed=set(autotune.TUNABLE),
                           clock=lambda: clock[0])
    drive(tuner, clock, lambda t: 1e9)
    assert tuner.done and tuner.current == START and len(tuner.samples) == 1


def test_the_csv_log_has_a_header_a_row_per_sample_and_the_best_last(tmp_path):
    path = tmp_path / "autotune.csv"
    clock = [0.0]
    settings = autotune.Settings(warmup_samples=2, max_samples=6, log_path=str(path))
    tuner = autotune.Tuner(settings, START, clock=lambda: clock[0])
    drive(tuner, clock, lambda t: surface(t, (20.0, 6.0)))
    rows = list(csv.reader(open(path)))
    assert tuple(rows[0]) == autotune.CSV_HEADER
    body, best = rows[1:-1], rows[-1]
    assert [r[1] for r in body[:2]] == ["warmup", "warmup"]
    assert len(body) == 2 + 6 + 4 and all(r[1] in ("bayes", "choices") for r in body[2:])
    assert best[0] == "best"
    assert float(best[-1]) == max(float(r[-1]) for r in body[2:])
    assert int(best[2]) == tuner.current.fusion_threshold_bytes


def test_a_step_ends_when_a_name_comes_again():
    clock = [0.0]
    tuner = autotune.Tuner(autotune.Settings(warmup_samples=0, steps_per_sample=2,
                                             max_samples=1), START,
                           fixed=set(autotune.TUNABLE) - {"inline_bytes"},
                           clock=lambda: clock[0])
    # a step of two rounds (a, then b): 3 MB in 1 s
    for _ in range(3):
        tuner.observe(["a"], 1_000_000)
        clock[0] += 0.5
        tuner.observe(["b"], 2_000_000)
        clock[0] += 0.5
    assert tuner.samples and tuner.samples[0][1] == pytest.approx(3e6)


def test_the_bayesian_optimizer_is_deterministic():
    def run():
        opt = autotune.BayesianOptimizer(2, 0.8)
        for x in ([0.1, 0.1], [0.9, 0.5], [0.5, 0.9]):
            opt.add(x, -((x[0] - 0.4) ** 2) - (x[1] - 0.3) ** 2)
        return opt.suggest()
    assert np.array_equal(run(), run())


def test_search_steps_covers_a_whole_search():
    from ronde import _config

    cfg = _config.load({})
    assert autotune.search_steps(cfg) >= samples_budget(autotune.Settings.from_config(cfg))
