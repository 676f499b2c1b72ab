from __future__ import annotations

import re

import pytest

from ronde import ConfigError, _knobs
from ronde._config import load, parse_bytes, setting


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


NUMERIC = [k for k in _knobs.KNOBS if k.accepted is not None]


@pytest.mark.parametrize("var, knob", [pytest.param(var, k, id=var) for k in NUMERIC
                                       for var in (k.var, *k.horovod)])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "99999999999999", "-1e300"])
def test_every_numeric_knob_refuses_nan_infinities_and_absurd_values(var, knob, raw):
    # the message names the variable actually set (a Horovod fallback too) and the range
    with pytest.raises(ConfigError, match=rf"^{var}\b.*{re.escape(raw)}.*"
                                          rf"\(accepted: {re.escape(str(knob.accepted))}"):
        load({var: raw})


@pytest.mark.parametrize("env, message", [
    ({"RONDE_CYCLE_TIME": "nan"},
     "RONDE_CYCLE_TIME='nan' is not a finite number (accepted: > 0 and <= 60000 milliseconds)"),
    ({"RONDE_CYCLE_TIME": "inf"},
     "RONDE_CYCLE_TIME='inf' is not a finite number (accepted: > 0 and <= 60000 milliseconds)"),
    ({"HOROVOD_CYCLE_TIME": "-inf"},
     "HOROVOD_CYCLE_TIME='-inf' is not a finite number (accepted: > 0 and <= 60000 "
     "milliseconds)"),
    ({"RONDE_CYCLE_TIME": "0"},
     "RONDE_CYCLE_TIME='0' is out of range (accepted: > 0 and <= 60000 milliseconds)"),
    ({"RONDE_START_TIMEOUT": "nan"},
     "RONDE_START_TIMEOUT='nan' is not a finite number (accepted: > 0 and <= 31536000 "
     "seconds)"),
    ({"HOROVOD_START_TIMEOUT": "1e300"},
     "HOROVOD_START_TIMEOUT='1e300' is out of range (accepted: > 0 and <= 31536000 seconds)"),
    ({"RONDE_FUSION_THRESHOLD": "nan"},
     "RONDE_FUSION_THRESHOLD: cannot parse byte size 'nan'; write e.g. 67108864 or 64MB "
     "(accepted: >= 0 and <= 64GiB)"),
    ({"HOROVOD_FUSION_THRESHOLD": "1000GB"},
     "HOROVOD_FUSION_THRESHOLD='1000GB' is out of range (accepted: >= 0 and <= 64GiB)"),
    ({"RONDE_SHM_SEGMENT": "4KiB"},
     "RONDE_SHM_SEGMENT='4KiB' is out of range (accepted: >= 64KiB and <= 64GiB)"),
    ({"RONDE_CACHE_CAPACITY": "nan"},
     "RONDE_CACHE_CAPACITY='nan' is not a valid int (accepted: >= 0 and <= 1048576 entries)"),
    ({"RONDE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0"},
     "RONDE_AUTOTUNE_GAUSSIAN_PROCESS_NOISE='0' is out of range (accepted: > 0 and <= 1000)"),
])
def test_bad_numbers_name_the_variable_and_the_range(env, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        load(env)


def test_the_range_edges_are_accepted():
    cfg = load({"RONDE_CYCLE_TIME": "60000", "RONDE_SHM_SEGMENT": "64KiB",
                "RONDE_STALL_SHUTDOWN_TIME": "0", "RONDE_FUSION_THRESHOLD": "64GiB",
                "HOROVOD_START_TIMEOUT": "31536000", "RONDE_AUTOTUNE_STEPS_PER_SAMPLE": "1"})
    assert (cfg.cycle_time_ms, cfg.shm_segment_bytes, cfg.stall_shutdown_time_s) == \
        (60000.0, 64 << 10, 0.0)
    assert (cfg.fusion_threshold_bytes, cfg.start_timeout_s) == (64 << 30, 31536000.0)


def test_a_byte_size_of_hundreds_of_digits_is_a_config_error():
    with pytest.raises(ConfigError, match="byte size '9{400}' is too large"):
        parse_bytes("9" * 400)
    with pytest.raises(ConfigError, match=r"^RONDE_INLINE_BYTES: byte size .* is too large"):
        load({"RONDE_INLINE_BYTES": "9" * 400})


def test_overrides_are_checked_too():
    with pytest.raises(ConfigError, match=r"^cycle_time_ms=nan \(RONDE_CYCLE_TIME\) is not a "
                                          r"finite number \(accepted: > 0"):
        load({}, cycle_time_ms=float("nan"))


def test_setting_reads_one_knob_as_load_does():
    assert setting("start_timeout_s", {}) is None
    assert setting("start_timeout_s", {"HOROVOD_START_TIMEOUT": "5"}) == 5.0
    with pytest.raises(ConfigError, match=r"^HOROVOD_START_TIMEOUT='nan' is not a finite"):
        setting("start_timeout_s", {"HOROVOD_START_TIMEOUT": "nan"})


def test_bind_addr_is_an_address_or_a_name_that_resolves():
    """Issue #50: RONDE_BIND_ADDR was taken as it was, and a bad one ended a rank's
    start with a raw socket.gaierror; it is checked where every knob is."""
    assert load({"RONDE_BIND_ADDR": "[::1]"}).bind_addr == "::1"
    assert load({"RONDE_BIND_ADDR": " 10.0.0.5 "}).bind_addr == "10.0.0.5"
    assert load({"RONDE_BIND_ADDR": "localhost"}).bind_addr == "localhost"
    for bad in ("no.such.host.invalid", "a b", "x" * 2000):
        for read in (lambda env: load(env), lambda env: setting("bind_addr", env)):
            with pytest.raises(ConfigError, match=r"^RONDE_BIND_ADDR: '.*'.* is neither an IP "
                               r"address nor a host name that resolves \(.*\); set it to an "
                               r"address of this machine that the peers reach"):
                read({"RONDE_BIND_ADDR": bad})
