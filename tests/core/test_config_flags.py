"""The fused-path flags: FUSEMLA_FUSED_DECODE / FUSEMLA_FUSED_PREFILL and MLAConfig."""

from __future__ import annotations

import dataclasses

import pytest

import fusemla
from fusemla import config
from fusemla.config import FUSED_DECODE_ENV, FUSED_PREFILL_ENV, MLAConfig
from fusemla.errors import FuseMLAError, FuseMLATypeError, FuseMLAValueError

ENV = (FUSED_DECODE_ENV, FUSED_PREFILL_ENV)
ON = ["1", "true", "yes", "on", "TRUE", " On ", "Yes\n"]
OFF = ["0", "false", "no", "off", "OFF", " False ", "NO"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "literal, which", [("FUSEMLA_FUSED_DECODE", 0), ("FUSEMLA_FUSED_PREFILL", 1)]
)
def test_documented_names_are_the_ones_read(monkeypatch, literal, which):
    # the names the README documents, set literally, are what the flags read
    monkeypatch.setenv(literal, "0")
    got = MLAConfig().resolve()
    assert got[which] is False and got[1 - which] is True
    assert fusemla.MLAConfig is MLAConfig


@pytest.mark.parametrize("value", ["", "   "])
def test_default_on_when_unset_or_empty(monkeypatch, value):
    assert MLAConfig().resolve() == (True, True)
    for name in ENV:
        monkeypatch.setenv(name, value)
    assert MLAConfig().resolve() == (True, True)
    assert config.fused_decode() is True and config.fused_prefill() is True


@pytest.mark.parametrize("which", [0, 1], ids=["decode", "prefill"])
@pytest.mark.parametrize("value,expected", [(v, True) for v in ON] + [(v, False) for v in OFF])
def test_env_values(monkeypatch, which, value, expected):
    monkeypatch.setenv(ENV[which], value)
    got = MLAConfig().resolve()
    assert got[which] is expected and got[1 - which] is True
    assert (config.fused_decode, config.fused_prefill)[which]() is expected


@pytest.mark.parametrize("which", [0, 1], ids=["decode", "prefill"])
@pytest.mark.parametrize("value", ["2", "maybe", "enabled", "onn", "-1", "y"])
def test_bad_env_value_names_the_variable(monkeypatch, which, value):
    monkeypatch.setenv(ENV[which], value)
    with pytest.raises(FuseMLAValueError) as info:
        MLAConfig().resolve()
    msg = str(info.value)
    assert ENV[which] in msg and repr(value) in msg
    assert "1/true/yes/on" in msg and "0/false/no/off" in msg
    assert isinstance(info.value, FuseMLAError) and isinstance(info.value, ValueError)


def test_explicit_fields_override_and_skip_the_env(monkeypatch):
    monkeypatch.setenv(FUSED_DECODE_ENV, "0")
    monkeypatch.setenv(FUSED_PREFILL_ENV, "garbage")
    assert MLAConfig(fused_decode=True, fused_prefill=False).resolve() == (True, False)
    with pytest.raises(FuseMLAValueError, match=FUSED_PREFILL_ENV):
        MLAConfig(fused_decode=True).resolve()
    assert MLAConfig(fused_prefill=True).resolve() == (False, True)


def test_env_is_read_at_resolve_time(monkeypatch):
    cfg = MLAConfig()
    assert cfg.resolve() == (True, True)
    monkeypatch.setenv(FUSED_DECODE_ENV, "off")
    assert cfg.resolve() == (False, True)
    monkeypatch.setenv(FUSED_PREFILL_ENV, "no")
    assert cfg.resolve() == (False, False)


@pytest.mark.parametrize("field", ["fused_decode", "fused_prefill"])
@pytest.mark.parametrize("value", [1, 0, "on", "true", 1.0])
def test_config_fields_must_be_bool_or_none(field, value):
    with pytest.raises(FuseMLATypeError, match=rf"^{field}:"):
        MLAConfig(**{field: value})


def test_config_is_frozen():
    cfg = MLAConfig(True, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fused_decode = False
    assert MLAConfig(True, False) == cfg
