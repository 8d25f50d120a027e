"""The one table of FUSEMLA_* variables (fusemla.envs): every variable parses strictly, the
README lists exactly the users' ones, and nothing in the repository names a FUSEMLA_* variable
the table lacks or reads one around it; TRITON_INTERPRET is read only through Triton."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusemla import envs
from fusemla.errors import FuseMLAValueError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"FUSEMLA_[A-Z0-9_]*[A-Z0-9]")
SOURCES = [
    p
    for d in ("fusemla", "benchmarks", "tests", ".ci")
    for p in sorted((ROOT / d).rglob("*"))
    if p.is_file() and p.suffix in (".py", ".sh", "") and "results" not in p.parts
]


@pytest.mark.parametrize("name", list(envs.VARIABLES))
def test_default_and_a_bad_value(monkeypatch, name):
    v = envs.VARIABLES[name]
    monkeypatch.delenv(name, raising=False)
    assert envs.get(name) == v.default
    monkeypatch.setenv(name, "  ")
    assert envs.get(name) == v.default  # empty counts as unset
    if v.kind == "text":
        monkeypatch.setenv(name, "x y")
        assert envs.get(name) == "x y"
        return
    monkeypatch.setenv(name, "surely-not-a-value")
    with pytest.raises(FuseMLAValueError) as err:
        envs.get(name)
    msg = str(err.value)
    assert name in msg and v.allowed() in msg and "surely-not-a-value" in msg
    # and the report says so instead of raising
    line = [x for x in envs.report(None) if x.startswith(name + ":")]
    assert len(line) == 1 and "INVALID" in line[0]


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "0", "false", "No", "off"])
def test_switch_spellings(monkeypatch, value):
    monkeypatch.setenv("FUSEMLA_DEBUG_CHECKS", value)
    assert envs.get("FUSEMLA_DEBUG_CHECKS") is (value.strip().lower() in ("1", "true", "yes", "on"))


@pytest.mark.parametrize("value", ["2", "y", "enable"])
def test_switch_is_strict(monkeypatch, value):
    """FUSEMLA_DEBUG_CHECKS=2 used to be silently off."""
    monkeypatch.setenv("FUSEMLA_DEBUG_CHECKS", value)
    with pytest.raises(FuseMLAValueError, match="FUSEMLA_DEBUG_CHECKS"):
        envs.get("FUSEMLA_DEBUG_CHECKS")


def test_unknown_name_is_a_key_error():
    name = "FUSEMLA_" + "NOPE"  # spelled apart: the scan below would flag it
    with pytest.raises(KeyError, match=name):
        envs.get(name)


def test_readme_lists_the_users_variables():
    text = (ROOT / "README.md").read_text()
    mentioned = set(NAME.findall(text))
    users = {n for n, v in envs.VARIABLES.items() if v.scope == "library"}
    assert users <= mentioned, f"README misses {sorted(users - mentioned)}"
    assert mentioned <= set(envs.VARIABLES), (
        f"README names {sorted(mentioned - set(envs.VARIABLES))}"
    )


def test_every_name_in_the_code_is_in_the_table():
    unknown = {}
    for p in SOURCES:
        for n in NAME.findall(p.read_text(errors="replace")):
            if n not in envs.VARIABLES:
                unknown.setdefault(n, str(p.relative_to(ROOT)))
    assert not unknown, f"FUSEMLA_* names missing from fusemla.envs.VARIABLES: {unknown}"


def test_the_library_reads_its_variables_only_through_the_table():
    read = re.compile(r"(os\.environ\.get|os\.getenv|os\.environ\[)\(?\s*[\"']FUSEMLA_")
    offenders = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if p.parts[len(ROOT.parts)] == "fusemla"
        and p.name != "envs.py"
        and read.search(p.read_text())
    ]
    assert not offenders, offenders


def test_triton_interpret_is_read_only_through_triton(monkeypatch):
    """Triton accepts spellings fusemla used to reject (TRITON_INTERPRET=y interprets): only
    Triton decides. Writing it (the CLI sets it for the demo) and showing it are allowed."""
    parse = re.compile(
        r"(environ\.get|getenv|environ\[)\(?\s*[\"']TRITON_INTERPRET[\"'][^\n]*(==|!=|\bin\b)"
    )
    offenders = [
        str(p.relative_to(ROOT))
        for p in SOURCES
        if p.parts[len(ROOT.parts)] in ("fusemla", "benchmarks") and parse.search(p.read_text())
    ]
    assert not offenders, offenders
    from fusemla.config import interpreting

    for value, want in (("y", True), ("1", True), ("0", False)):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert interpreting() is want
