from __future__ import annotations

import pytest

from ronde import ConfigError
from ronde._config import load, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("67108864", 67108864), ("64MB", 64 << 20), ("64 MiB", 64 << 20), ("1.5k", 1536),
    ("2GiB", 2 << 30), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ConfigError, match="cannot parse byte size"):
        parse_bytes("lots")


def test_defaults():
    cfg = load({})
    assert cfg.fusion_threshold_bytes == 64 << 20 and cfg.transport == "auto"
    assert cfg.stall_shutdown_time_s > 0  # a finite default: a stalled job ends by itself


def test_ronde_variables_win_over_horovod_fallbacks():
    cfg = load({"HOROVOD_FUSION_THRESHOLD": "1048576", "HOROVOD_CYCLE_TIME": "5"})
    assert cfg.fusion_threshold_bytes == 1 << 20 and cfg.cycle_time_ms == 5.0
    cfg = load({"HOROVOD_FUSION_THRESHOLD": "1048576", "RONDE_FUSION_THRESHOLD": "2MB"})
    assert cfg.fusion_threshold_bytes == 2 << 20


def test_bad_values_name_the_variable():
    with pytest.raises(ConfigError, match="RONDE_TRANSPORT='carrier-pigeon'"):
        load({"RONDE_TRANSPORT": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="RONDE_CYCLE_TIME"):
        load({"RONDE_CYCLE_TIME": "soon"})
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD"):
        load({"HOROVOD_FUSION_THRESHOLD": "big"})
