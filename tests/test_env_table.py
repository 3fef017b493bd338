"""One environment table: specbench/env.py is the only home of the `SPECBENCH_*` variables (issue 46, point 6).

A scan of the source tree fails on any read of a `SPECBENCH_` variable outside specbench/env.py (planted reads
show it does), every `SPECBENCH_` name written in code, scripts, docs or CI is in the table, docs/env.md holds
the table as `env.markdown()` renders it, and the accessors read each kind as the table says: defaults when
unset or empty, refusals in one line naming the variable, a KeyError for a name the table does not hold."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specbench import env
from specbench.engine.config import (
    DECODE_ATTENTION,
    PADDED_ROWS,
    SPEC_POLICIES,
    ConfigError,
    EngineConfig,
    SpecConfig,
)

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / "specbench" / "env.py"
PY_DIRS = ("cli", "engine", "harness", "suites", "kernels", "benchmarks", "scripts", "tests")
NAME = re.compile(r"SPECBENCH_[A-Z0-9_]+")
SELF = Path(__file__).resolve()  # its planted reads and names are made up on purpose


def _py_files() -> list[Path]:
    files = [p for d in PY_DIRS for p in sorted((ROOT / d).rglob("*.py")) if "__pycache__" not in p.parts]
    return files + sorted((ROOT / "specbench").glob("*.py"))  # its own modules, not the links to the folders


def _text_files() -> list[Path]:
    """Where a variable's name may be written: code, scripts, docs, the Makefile and CI."""
    out = _py_files() + sorted((ROOT / "scripts").glob("*.sh")) + sorted((ROOT / "docs").glob("*.md"))
    out += [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / ".github").rglob("*.yml")),
            *sorted((ROOT / ".ci").glob("*"))]
    return [p for p in out if p.is_file() and p.resolve() != SELF]


# --- the scan: no read of a SPECBENCH_ variable outside specbench/env.py ---------------------------------------

def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "getenv")


def _strings(node: ast.AST | None) -> list[str] | None:
    """The strings a literal holds (a tuple, list or dict's values), or None when it is not one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = [_strings(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        items = [_strings(v) for v in node.values]
    else:
        return None
    return None if any(i is None for i in items) else [s for i in items for s in i or []]


def _bindings(tree: ast.AST) -> dict[str, list[str]]:
    """Names bound to string literals anywhere in a module: `X = "..."`, `X = {...: "..."}`, and loop or
    comprehension targets over a literal tuple or list."""
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.For | ast.comprehension):
            pairs = [(node.target, node.iter)]
        for target, value in pairs:
            got = _strings(value)
            if isinstance(target, ast.Name) and got is not None:
                out.setdefault(target.id, []).extend(got)
    return out


def _key(node: ast.AST, local: dict[str, list[str]], known: dict[str, list[str]]) -> list[str] | None:
    """The variable names a read's key can be, or None where the scan cannot tell."""
    if isinstance(node, ast.JoinedStr):
        head = node.values[0] if node.values else None
        return [head.value] if isinstance(head, ast.Constant) and isinstance(head.value, str) else None
    if isinstance(node, ast.Name):  # this module's constant, or one imported by name
        return local.get(node.id, known.get(node.id))
    if isinstance(node, ast.Attribute):  # another module's constant: mod.ENV
        return known.get(node.attr)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name | ast.Attribute):  # LEVERS["gate"]
        return _key(node.value, local, known)
    if isinstance(node, ast.BinOp):  # "SPECBENCH_" + x
        return _key(node.left, local, known)
    return _strings(node)


def env_reads(source: str, known: dict[str, list[str]] | None = None) -> list[tuple[int, str]]:
    """(line, what) for every read of the process environment whose key is a `SPECBENCH_` name or cannot be told
    (a read through a parameter is how a helper hides which variable it reads). Writes are not reads:
    `os.environ[k] = v`, `del os.environ[k]`, and `pop` / `setdefault` whose value is not used."""
    tree = ast.parse(source)
    local = _bindings(tree)
    known = {**(known or {}), **local}
    unused = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    keys: list[tuple[int, ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if _is_getenv(f) or (isinstance(f, ast.Attribute) and _is_environ(f.value) and (
                    f.attr == "get" or (f.attr in ("pop", "setdefault") and id(node) not in unused))):
                keys.append((node.lineno, node.args[0]))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            keys.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(o, ast.In | ast.NotIn) for o in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            keys.append((node.lineno, node.left))
    out = []
    for line, key in keys:
        names = _key(key, local, known)
        if names is None:
            out.append((line, f"a name the scan cannot tell ({ast.unparse(key)})"))
        out += [(line, n) for n in names or () if n.startswith("SPECBENCH_")]
    return out


def _tree_constants() -> dict[str, list[str]]:
    """Every module's names bound to SPECBENCH_ strings (for reads of another module's constant)."""
    out: dict[str, list[str]] = {}
    for path in _py_files():
        for k, v in _bindings(ast.parse(path.read_text(encoding="utf-8"))).items():
            if any(s.startswith("SPECBENCH_") for s in v):
                out.setdefault(k, []).extend(v)
    return out


PLANTED_READS = [
    'import os\nos.environ.get("SPECBENCH_X")',
    'import os\nos.environ.get("SPECBENCH_X", "1").strip()',
    'import os\nv = os.environ["SPECBENCH_X"]',
    'import os\nif "SPECBENCH_X" in os.environ:\n    pass',
    'import os\nos.getenv("SPECBENCH_X")',
    'from os import environ\nenviron.get("SPECBENCH_X")',
    'from os import getenv\ngetenv("SPECBENCH_X")',
    'import os\nENV = "SPECBENCH_X"\nos.environ.get(ENV)',
    'import os\nLEVERS = {"gate": "SPECBENCH_X"}\nos.environ.get(LEVERS["gate"])',
    'import os\nimport mod\nos.environ.get(mod.TOPK_ENV)',
    'import os\nfrom mod import TOPK_ENV\nos.environ.get(TOPK_ENV)',
    'import os\nos.environ.get(f"SPECBENCH_{name}")',
    'import os\ndef f(name):\n    return os.environ.get(name)',
    'import os\nv = os.environ.pop("SPECBENCH_X", None)',
    'import os\nv = os.environ.setdefault("SPECBENCH_X", "1")',
]
HEALTHY = [
    'import os\nos.environ["SPECBENCH_X"] = "1"',
    'import os\nos.environ.pop("SPECBENCH_X", None)',
    'import os\nos.environ.setdefault("SPECBENCH_X", "1")',
    'import os\ndel os.environ["SPECBENCH_X"]',
    'import os\nos.environ.get("HOME")',
    'import os\nenv = dict(os.environ, SPECBENCH_X="1")',
    'import os\nrec = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "HOME")}',
    'import os\nany(os.environ.get(v) for v in ("http_proxy", "HTTP_PROXY"))',
    'from specbench import env\nenv.get("SPECBENCH_X")',
    'def t(monkeypatch):\n    monkeypatch.setenv("SPECBENCH_X", "1")',
]


@pytest.mark.parametrize("source", PLANTED_READS)
def test_the_scan_catches_a_planted_read(source):
    assert env_reads(source, {"TOPK_ENV": ["SPECBENCH_X"]}), source


@pytest.mark.parametrize("source", HEALTHY)
def test_the_scan_passes_writes_and_other_reads(source):
    assert env_reads(source) == [], source


def test_no_specbench_variable_is_read_outside_env_py():
    known = _tree_constants()
    bad = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _py_files() if path != HOME
           for line, what in env_reads(path.read_text(encoding="utf-8"), known)]
    assert not bad, "read SPECBENCH_* variables through specbench/env.py (env.get / env.flag):\n" + "\n".join(bad)


# --- names: every one written anywhere is in the table -----------------------------------------------------------

def unknown_names(text: str) -> set[str]:
    return set(NAME.findall(text)) - set(env.VARS)


def test_unknown_names_are_found():
    assert unknown_names("set SPECBENCH_NO_SUCH_THING=1, or SPECBENCH_GEMV=0") == {"SPECBENCH_NO_SUCH_THING"}
    assert unknown_names("`SPECBENCH_GEMV=0`, SPECBENCH_INVARIANTS, $SPECBENCH_RESULTS") == set()


def test_every_name_written_in_the_tree_is_in_the_table():
    bad = sorted(f"{p.relative_to(ROOT)}: {n}" for p in _text_files()
                 for n in unknown_names(p.read_text(encoding="utf-8", errors="replace")))
    assert not bad, "SPECBENCH_ names missing from specbench/env.py's table:\n" + "\n".join(bad)


def unused_rows(names: list[str], text: str) -> list[str]:
    return sorted(n for n in names if not re.search(rf"\b{n}\b", text))


def test_every_variable_in_the_table_is_used_somewhere():
    """A row nobody reads or writes is a stale row."""
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in _text_files()
                     if p.suffix in (".py", ".sh", ".yml") and p != HOME)
    assert unused_rows(["SPECBENCH_GEMV", "SPECBENCH_NO_SUCH_ROW"], "env.flag('SPECBENCH_GEMV_KINDS')") == \
        ["SPECBENCH_GEMV", "SPECBENCH_NO_SUCH_ROW"]  # a longer name is not a use
    unused = unused_rows(list(env.VARS), text)
    assert not unused, f"rows of specbench/env.py no code, script or test names: {unused}"


# --- docs/env.md is the rendering --------------------------------------------------------------------------------

BEGIN, END = "<!-- env table: begin -->\n", "<!-- env table: end -->"


def _section(doc: str) -> str:
    return doc.split(BEGIN, 1)[1].split(END, 1)[0]


def test_docs_hold_the_rendered_table():
    doc = (ROOT / "docs" / "env.md").read_text(encoding="utf-8")
    assert _section(doc) == env.markdown(), "docs/env.md's table is stale: paste `python -m specbench.env` there"
    stale = doc.replace("| 262144 |", "| 131072 |")
    assert stale != doc and _section(stale) != env.markdown()  # a changed default is caught
    assert "docs/env.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_rendering_has_one_row_per_variable():
    rows = [line for line in env.markdown().splitlines() if line.startswith("| `SPECBENCH_")]
    assert [r.split("`")[1] for r in rows] == list(env.VARS)
    for r in rows:
        assert r.count(" | ") == 3, r  # a | inside a cell is escaped


# --- the config's defaults are the table's rows ------------------------------------------------------------------

def _config_fields() -> dict[str, dataclasses.Field]:
    return {f"{cls.__name__}.{f.name}": f for cls in (EngineConfig, SpecConfig) for f in dataclasses.fields(cls)}


def test_every_environment_default_of_the_config_has_a_row():
    """A field whose default is computed (not a plain value, a SpecConfig or an empty dict) is one the table
    names: 21 of them, each read through its row."""
    computed = {k for k, f in _config_fields().items()
                if f.default_factory is not dataclasses.MISSING and f.default_factory not in (SpecConfig, dict)}
    rows = {v.field for v in env.VARS.values() if v.field}
    assert computed == rows and len(rows) == 21


def _other(var: env.Var) -> str:
    """A valid value of `var` other than its default, as text."""
    if var.kind == "flag":
        return "0" if var.default else "1"
    if var.kind == "choice":
        return next(str(c) for c in var.choices if c != var.default)
    return "16"


@pytest.mark.parametrize("var", [v for v in env.VARS.values() if v.field], ids=lambda v: v.name)
def test_each_config_default_follows_its_variable(monkeypatch, var):
    cls, name = var.field.split(".")
    build = (lambda: EngineConfig(model="x")) if cls == "EngineConfig" else SpecConfig
    monkeypatch.delenv(var.name, raising=False)
    assert getattr(build(), name) == var.default
    monkeypatch.setenv(var.name, _other(var))
    got = getattr(build(), name)
    assert got == env.get(var.name) != var.default
    monkeypatch.setenv(var.name, "not-a-value")
    with pytest.raises(ConfigError, match=rf"^{var.name}='not-a-value' is invalid: expected "):
        build()


@pytest.mark.parametrize("name,vocabulary", [("SPECBENCH_PADDED_ROWS", PADDED_ROWS),
                                             ("SPECBENCH_DECODE_ATTENTION", DECODE_ATTENTION),
                                             ("SPECBENCH_SPEC_POLICY", SPEC_POLICIES)])
def test_choices_are_the_configs_vocabulary(name, vocabulary):
    assert set(env.VARS[name].choices) == set(vocabulary)


# --- the accessors ---------------------------------------------------------------------------------------------

def test_a_name_not_in_the_table_is_a_key_error():
    with pytest.raises(KeyError, match="SPECBENCH_GEMVV is not in specbench/env.py's table"):
        env.get("SPECBENCH_GEMVV")
    with pytest.raises(KeyError):
        env.flag("SPECBENCH_NOT_A_VARIABLE")
    with pytest.raises(TypeError, match="SPECBENCH_STEP_TRACE is no on/off flag"):
        env.flag("SPECBENCH_STEP_TRACE")
    with pytest.raises(TypeError, match="SPECBENCH_GRAPH_RUNNER"):  # unset means something of its own: env.get
        env.flag("SPECBENCH_GRAPH_RUNNER")


@pytest.mark.parametrize("name", list(env.VARS))
def test_unset_and_empty_are_the_default(monkeypatch, name):
    monkeypatch.delenv(name, raising=False)
    assert env.get(name) == env.default(name)
    monkeypatch.setenv(name, "")
    assert env.get(name) == env.default(name)


def test_flags_read_one_set_of_words(monkeypatch):
    for word, on in [("1", True), ("TRUE", True), (" yes ", True), ("On", True), ("0", False), ("false", False),
                     ("NO", False), ("off", False), ("  ", True)]:  # blank: the default (on)
        monkeypatch.setenv("SPECBENCH_GEMV", word)
        assert env.flag("SPECBENCH_GEMV") is on, word
    monkeypatch.setenv("SPECBENCH_GRAPH_RUNNER", "0")
    assert env.get("SPECBENCH_GRAPH_RUNNER") is False
    monkeypatch.setenv("SPECBENCH_ENGINE_PROCESS", "yes")  # its row takes 0 and 1 only, as the server always did
    with pytest.raises(env.EnvError, match=r"^SPECBENCH_ENGINE_PROCESS='yes' is invalid: expected 0 .* or 1 "):
        env.flag("SPECBENCH_ENGINE_PROCESS")


def test_each_kind_reads_and_refuses(monkeypatch):
    good = [("SPECBENCH_SPEC_GATE", " 3 ", 3), ("SPECBENCH_SPEC_POLICY", "1", "auto"),
            ("SPECBENCH_SPEC_POLICY", "AUTO", "auto"), ("SPECBENCH_DECODE_MERGE", "true", "fused"),
            ("SPECBENCH_DECODE_MERGE", "separate", "separate"), ("SPECBENCH_GIL_SWITCH_MS", "0.5", 0.5),
            ("SPECBENCH_GEMV_KINDS", "norm, swiglu,,bogus", ("norm", "swiglu", "bogus")),
            ("SPECBENCH_DECODE_SPLITS", "-3", -3), ("SPECBENCH_LLAMACPP", "Cached", "cached"),
            ("SPECBENCH_LLAMACPP", "off", "0"), ("SPECBENCH_API_KEY", " k ", " k "),
            ("SPECBENCH_LLAMACPP_CACHE", "/tmp/x", "/tmp/x")]
    for name, raw, want in good:
        monkeypatch.setenv(name, raw)
        assert env.get(name) == want, (name, raw)
    bad = [("SPECBENCH_SPEC_GATE", "-2", "an integer >= 0 (0 = off)"),
           ("SPECBENCH_SPEC_TRIM", "2.5", "an integer >= 0 (0 = off)"),
           ("SPECBENCH_SPEC_POLICY", "maybe", "off, auto, 0 or 1"),
           ("SPECBENCH_PADDED_ROWS", "rows", "ladder or bucket"),
           ("SPECBENCH_GIL_SWITCH_MS", "nan", "a number of ms in [0.01, 100]"),
           ("SPECBENCH_LLAMACPP_LIFETIME", "inf", "a number >= 1"),
           ("SPECBENCH_STEP_TRACE", "1e3", "an integer >= 0"),
           ("SPECBENCH_MAX_JSON_VALUES", "many", "an integer >= 0 (0 = no bound)"),
           ("SPECBENCH_TRITON", "2", "0 or 1 (unset: the default)")]
    for name, raw, accepted in bad:
        monkeypatch.setenv(name, raw)
        with pytest.raises(env.EnvError) as e:
            env.get(name)
        assert str(e.value) == f"{name}={raw!r} is invalid: expected {accepted}"


FLAG_ROWS = [v.name for v in env.VARS.values() if v.kind == "flag" and v.words is env.FLAG_WORDS]


@given(st.sampled_from(FLAG_ROWS), st.text(max_size=8))
def test_a_flag_is_one_of_its_words_or_refused_in_one_line(name, raw):
    var = env.VARS[name]
    try:
        got = var.parse(raw)
    except env.EnvError as e:
        assert raw.strip().lower() not in env.FLAG_WORDS and raw.strip()
        assert str(e).startswith(f"{name}=") and "\n" not in str(e)
        return
    want = env.FLAG_WORDS.get(raw.strip().lower(), var.default)
    assert got is want


@given(st.integers(min_value=-10**6, max_value=10**9))
def test_an_int_row_reads_what_was_written_within_its_range(n):
    var = env.VARS["SPECBENCH_MAX_JSON_VALUES"]
    if n >= 0:
        assert var.parse(str(n)) == n
    else:
        with pytest.raises(env.EnvError, match="SPECBENCH_MAX_JSON_VALUES"):
            var.parse(str(n))


def test_values_are_read_when_asked_for(monkeypatch):
    monkeypatch.setenv("SPECBENCH_STEP_TRACE", "7")
    assert env.get("SPECBENCH_STEP_TRACE") == 7
    monkeypatch.setenv("SPECBENCH_STEP_TRACE", "8")
    assert env.get("SPECBENCH_STEP_TRACE") == 8


def test_env_imports_nothing_of_ours():
    tree = ast.parse(HOME.read_text(encoding="utf-8"))
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith(("specbench", ".")) for m in mods), mods
    assert mods <= {"__future__", "math", "os", "re", "collections.abc", "dataclasses", "typing"}, mods
