"""The README says what the code does: its example runs (in a fresh process, the Triton kernel
itself, checked against the reference), its API section's signatures are the real ones (every
parameter, kind, default and return annotation), every ``fusemla.*`` name and keyword it mentions
there exists, its first screen holds the three commands and the headline paragraph, and every
relative link of the README and docs/*.md reaches a file and a heading that exist."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE_HEADING = "## Example"
API_HEADING = "## API in brief"
#: the public functions the API section must give in full
CORE = (
    "mla_prologue",
    "prologue_spec",
    "mla_prologue_step",
    "mla_decode_prologue",
    "mla_epilogue",
    "epilogue_spec",
    "mla_epilogue_step",
)
FIRST_BLOCK = 'pip install -e ".[test]"\npython -m fusemla demo\npython -m pytest -q'

# Runs the example with the launcher counted: the example passes only if the kernel itself ran
# (not the reference the op falls back to for CPU tensors without the interpreter).
RUNNER = """
import runpy, sys
import fusemla.ops.prologue.launch as launch
calls = []
real = launch.launch
def counted(args):
    calls.append(args.N)
    return real(args)
launch.launch = counted
runpy.run_path(sys.argv[1], run_name="__main__")
print("kernel launches:", len(calls))
"""


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(text: str, heading: str) -> str:
    """The text from ``heading`` (a whole line) to the next heading of the same level."""
    lines = text.splitlines()
    assert heading in lines, f"README has no {heading!r} heading"
    start = lines.index(heading) + 1
    level = heading.split()[0] + " "
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith(level)),
        len(lines),
    )
    return "\n".join(lines[start:end])


def first_block(text: str, lang: str) -> str:
    m = re.search(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)
    assert m, f"no ```{lang} block"
    return m.group(1)


# --------------------------------------------------------------------------------------------
# the example
# --------------------------------------------------------------------------------------------


def test_the_example_runs_the_kernel_and_agrees(tmp_path, device):
    script = tmp_path / "readme_example.py"
    script.write_text(first_block(section(readme(), EXAMPLE_HEADING), "python"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run stays on the CPU on a GPU machine too
        where = "cpu"
    else:
        env.pop("TRITON_INTERPRET", None)
        where = "cuda"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "q (2, 4, 80) q_pe (3, 4, 16) k_pe (3, 16)" in out, out
    assert f"fused prologue == reference on {where}" in out, out
    assert "kernel launches: 1" in out, out


# --------------------------------------------------------------------------------------------
# the API section
# --------------------------------------------------------------------------------------------


def api_stubs(block: str) -> list[tuple[str, ast.FunctionDef]]:
    """(module, stub) for each ``def`` of the API block; a ``# fusemla[.sub]`` comment line
    names the module of the stubs below it."""
    markers = [
        (i + 1, line[2:].strip())
        for i, line in enumerate(block.splitlines())
        if re.fullmatch(r"# fusemla(\.\w+)*", line.strip())
    ]
    stubs = []
    for node in ast.parse(block).body:
        assert isinstance(node, ast.FunctionDef), f"line {node.lineno}: only def stubs here"
        before = [mod for line, mod in markers if line < node.lineno]
        assert before, f"{node.name}: no '# fusemla...' module line above it"
        stubs.append((before[-1], node))
    return stubs


def _annotation_text(annotation: object) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return ast.unparse(ast.parse(text, mode="eval"))


def stub_mismatches(module: str, stub: ast.FunctionDef) -> list[str]:
    """How a README stub differs from the real function's signature (empty: it matches)."""
    name = f"{module}.{stub.name}"
    fn = getattr(importlib.import_module(module), stub.name, None)
    if fn is None:
        return [f"{name}: no such function"]
    real = inspect.signature(fn)
    a = stub.args
    if a.vararg or a.kwarg or a.posonlyargs:
        return [f"{name}: the README stub uses *args / **kwargs / '/'"]
    positional_defaults = [None] * (len(a.args) - len(a.defaults)) + list(a.defaults)
    listed = [(p.arg, "positional", d) for p, d in zip(a.args, positional_defaults)]
    listed += [(p.arg, "keyword", d) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    kinds = {
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
    }
    problems = []
    real_names = [p.name for p in real.parameters.values()]
    readme_names = [n for n, _, _ in listed]
    if readme_names != real_names:
        problems.append(
            f"{name}: README lists {readme_names}, the function takes {real_names}"
            f" (missing {sorted(set(real_names) - set(readme_names))},"
            f" unknown {sorted(set(readme_names) - set(real_names))})"
        )
    for pname, kind, default in listed:
        p = real.parameters.get(pname)
        if p is None:
            continue
        if kinds.get(p.kind) != kind:
            problems.append(
                f"{name}({pname}): README says {kind}, the function {p.kind.description}"
            )
        if default is None:
            if p.default is not inspect.Parameter.empty:
                problems.append(f"{name}({pname}): README gives no default, real {p.default!r}")
            continue
        value = eval(compile(ast.Expression(default), "<README>", "eval"), {"torch": torch})
        if p.default is inspect.Parameter.empty or p.default != value:
            problems.append(f"{name}({pname}): README default {value!r}, real {p.default!r}")
    if stub.returns is not None:
        said = ast.unparse(stub.returns)
        if real.return_annotation is inspect.Signature.empty:
            problems.append(f"{name}: README says it returns {said}, it is not annotated")
        elif _annotation_text(real.return_annotation) != said:
            problems.append(
                f"{name}: README says it returns {said}, the function "
                f"{_annotation_text(real.return_annotation)}"
            )
    return problems


def test_api_signatures_are_the_real_ones():
    stubs = api_stubs(first_block(section(readme(), API_HEADING), "python"))
    given = {f"{m}.{s.name}" for m, s in stubs}
    missing = [f for f in CORE if f"fusemla.{f}" not in given]
    assert not missing, f"the README's API section lacks {missing}"
    problems = [p for m, s in stubs for p in stub_mismatches(m, s)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "edit, expected",
    [
        (("act_quant=None,\n) -> PrologueOutput", ") -> PrologueOutput"), "missing ['act_quant']"),
        (("q_scale=None, act_quant=None,\n)", "q_scale=None, act_quant=None, x=1,\n)"), "['x']"),
        (("rope_applied=False, kv_scale", "rope_applied=True, kv_scale"), "rope_applied"),
        (("*, num_decode_tokens=None, is_neox", "num_decode_tokens=None, *, is_neox"), "keyword"),
        ((") -> PrologueOutput: ...  # (q", ") -> tuple: ...  # (q"), "returns tuple"),
        (("def mla_prologue(", "def mla_prologue_fused("), "no such function"),
    ],
    ids=["missing-kw", "unknown-kw", "wrong-default", "wrong-kind", "wrong-return", "wrong-name"],
)
def test_the_signature_check_catches(edit, expected):
    """The check above fails on a README stub that is wrong in any of these ways."""
    block = first_block(section(readme(), API_HEADING), "python")
    old, new = edit
    assert block.count(old) >= 1, old
    stubs = api_stubs(block.replace(old, new, 1))
    problems = [p for m, s in stubs for p in stub_mismatches(m, s)]
    assert any(expected in p for p in problems), problems


def test_api_prose_names_exist():
    """Every ``fusemla.x.y`` the API section names resolves, and every ``keyword=value`` code
    span it shows names a parameter of one of the functions its block lists."""
    text = section(readme(), API_HEADING)
    prose = re.sub(r"^```.*?^```$", "", text, flags=re.S | re.M)
    code = re.findall(r"`([^`\n]+)`", prose.replace("\n  ", " "))
    unresolved = []
    for dotted in sorted({m for c in code for m in re.findall(r"\bfusemla(?:\.\w+)+", c)}):
        parts = dotted.split(".")
        obj, i = None, len(parts)
        while i > 0:  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is None:
            unresolved.append(dotted)
    assert not unresolved, f"the README's API section names {unresolved}"
    params = set()
    for module, stub in api_stubs(first_block(text, "python")):
        fn = getattr(importlib.import_module(module), stub.name)
        params |= set(inspect.signature(fn).parameters)
    # a code span that shows `keyword=value` (not `torch.compile(fullgraph=True)`)
    keywords = {m.group(1) for c in code if (m := re.match(r"([a-z_]\w*)=(?!=)", c))}
    assert keywords, "the check found no keyword in the API section"
    unknown = sorted(keywords - params)
    assert not unknown, f"the README's API section shows keywords no function takes: {unknown}"


# --------------------------------------------------------------------------------------------
# first screen, links
# --------------------------------------------------------------------------------------------


def test_first_screen():
    text = readme()
    lines = text.splitlines()
    assert first_block(text, "bash").rstrip("\n") == FIRST_BLOCK  # .ci/run runs it verbatim
    block_line = lines.index("```bash")
    assert block_line < 40, f"the install block starts at line {block_line + 1}"
    starts = [i for i, x in enumerate(lines) if x.startswith("<!-- headline")]
    ends = [i for i, x in enumerate(lines) if x == "<!-- /headline -->"]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0] < block_line
    paragraph = lines[starts[0] + 1 : ends[0]]
    assert paragraph and all(x.strip() for x in paragraph), "the headline is one paragraph"
    assert "vLLM" in paragraph[0] and "docs/results.md" in "\n".join(paragraph)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a markdown heading (lower case, punctuation dropped, spaces to -)."""
    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_github_anchor():
    assert github_anchor("The vLLM plugin, verified (H200, vLLM 0.32.0 / 0.33.0, dfbba2c)") == (
        "the-vllm-plugin-verified-h200-vllm-0320--0330-dfbba2c"
    )
    assert github_anchor("`FUSEMLA_VLLM_W_UK` against vLLM's bf16 path") == (
        "fusemla_vllm_w_uk-against-vllms-bf16-path"
    )


@pytest.mark.parametrize(
    "doc", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_relative_links_resolve(doc):
    text = re.sub(r"^```.*?^```$", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT)}")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
