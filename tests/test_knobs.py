"""Every knob is declared once (ronde._knobs) and the docs, Config and ronderun agree."""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import pytest

from ronde import _config, _knob_docs, _knobs
from ronde.runner.cli import build_parser

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "configuration.md")


def test_the_docs_tables_are_generated_from_the_knobs():
    with open(DOCS, encoding="utf-8") as fh:
        text = fh.read()
    assert _knob_docs.render(text) == text, \
        "stale: python -m ronde._knob_docs --write docs/configuration.md"


def test_every_config_field_has_exactly_one_knob():
    fields = [f.name for f in dataclasses.fields(_config.Config)]
    knobs = [k.field for k in _knobs.KNOBS]
    assert sorted(knobs) == sorted(fields)
    assert len({k.var for k in _knobs.KNOBS}) == len(knobs)


@pytest.mark.parametrize("knob", _knobs.KNOBS, ids=lambda k: k.var)
def test_the_shown_default_is_the_config_default(knob):
    default = getattr(_config.Config(), knob.field)
    shown = re.search(r"`([^`]*)`", knob.default)
    if shown is None:  # "empty ..."
        assert knob.default.startswith("empty") and default == ""
    else:
        assert knob.parse(shown.group(1)) == default


@pytest.mark.parametrize("knob", [k for k in _knobs.KNOBS if k.flag], ids=lambda k: k.var)
def test_each_flag_exists(knob):
    parser = build_parser()
    flag = knob.flag.split()[0]
    assert flag in parser._option_string_actions, flag  # argparse's table of flags


def test_an_unknown_ronde_variable_is_warned_about_with_the_closest_knob(caplog):
    env = {"RONDE_FUSION_TRESHOLD": "1MB", "RONDE_RANK": "0", "RONDE_SPIN_TIME": "10",
           "RONDE_WHATEVER": "1"}
    assert _config.unknown_variables(env) == [("RONDE_FUSION_TRESHOLD", "RONDE_FUSION_THRESHOLD"),
                                              ("RONDE_WHATEVER", None)]
    with caplog.at_level(logging.WARNING, logger="ronde._config"):
        cfg = _config.load(env)
    assert cfg.spin_time_us == 10.0
    assert "RONDE_FUSION_TRESHOLD is not a ronde setting" in caplog.text
    assert "did you mean RONDE_FUSION_THRESHOLD?" in caplog.text


@pytest.mark.parametrize("knob", _knobs.KNOBS, ids=lambda k: k.var)
def test_every_numeric_knob_has_a_finite_range_holding_its_default(knob):
    if knob.parse not in (int, float, _knobs.parse_bytes):
        assert knob.accepted is None
        return
    assert knob.accepted is not None, f"{knob.var}: give it accepted=Range(...)"
    assert getattr(_config.Config(), knob.field) in knob.accepted
    assert float("nan") not in knob.accepted and float("inf") not in knob.accepted
    assert float("-inf") not in knob.accepted
