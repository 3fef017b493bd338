"""One verdict type: harness/verdicts.Verdict is the only home of the verdict words, their rank and their exit
codes (issue 46, point 2). The kinds' algebra is checked here, and a scan of the source tree fails on any
verdict literal written outside that home."""

from __future__ import annotations

import ast
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from specbench.harness.verdicts import (
    CANNOT_TEST,
    EXIT_CANNOT_TEST,
    EXIT_FAIL,
    EXIT_OK,
    FAIL,
    PASS,
    PASS_ASSERTED,
    Verdict,
    combine,
    exit_code,
    is_cannot_test,
    is_pass,
)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "engine", "harness", "suites", "benchmarks", "scripts", "kernels")
HOME = ROOT / "harness" / "verdicts.py"


def test_of_reads_the_kind_of_qualified_verdicts():
    assert Verdict.of("PASS") is PASS
    assert Verdict.of(PASS_ASSERTED) is PASS
    assert Verdict.of("PASS (no rejection tested)") is PASS
    assert Verdict.of("CANNOT TEST (no testable cell)") is CANNOT_TEST
    assert Verdict.of("CANNOT TEST: no token ids") is CANNOT_TEST
    assert Verdict.of("NOT SPECULATING") is Verdict.NOT_SPECULATING
    assert Verdict.of("INCOMPLETE (interrupted)") is Verdict.INCOMPLETE
    # what nobody can read is no pass, and no word is read from inside another
    for junk in ("", None, "PASSED", "pass", "FAILURE", "n/a"):
        assert Verdict.of(junk) is Verdict.ERROR, junk


def test_a_member_is_its_word_in_records():
    import json

    assert PASS == "PASS" and f"{CANNOT_TEST}" == "CANNOT TEST" and str(FAIL) == "FAIL"
    assert json.loads(json.dumps({"v": CANNOT_TEST})) == {"v": "CANNOT TEST"}
    assert PASS.qualified("x") == "PASS (x)" and CANNOT_TEST.because("y") == "CANNOT TEST: y"


def test_exit_codes_and_tests():
    assert exit_code(PASS_ASSERTED) == EXIT_OK and is_pass(PASS_ASSERTED)
    assert exit_code("CANNOT TEST (why)") == EXIT_CANNOT_TEST and is_cannot_test("CANNOT TEST (why)")
    for v in ("FAIL", "NOT SPECULATING", "NO DRAFT ACCEPTED", "INCOMPLETE", "ERROR", "garbage"):
        assert exit_code(v) == EXIT_FAIL and not is_pass(v)


words = st.sampled_from([k.value for k in Verdict] + [PASS_ASSERTED, "PASS (no rejection tested)",
                                                        "CANNOT TEST (no testable cell)", "FAIL (seed repeat)"])


@given(st.lists(words, max_size=6))
def test_combine_is_the_highest_rank(vs):
    out = combine(vs)
    if not vs:
        assert out == CANNOT_TEST
        return
    top = max(Verdict.of(v).rank for v in vs)
    assert Verdict.of(out).rank == top
    assert out in vs or out == CANNOT_TEST
    # the order of the gates never changes the kind (nor the exit code)
    assert Verdict.of(combine(list(reversed(vs)))) is Verdict.of(out) or top == 2
    assert exit_code(combine(list(reversed(vs)))) == exit_code(out)


def _literals(tree: ast.AST):
    """Every string constant a program uses (docstrings left out), with its line; an f-string by its leading
    text."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for part in node.values:
                docs.add(id(part))
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and isinstance(head.value, str):
                yield node.lineno, head.value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.lineno, node.value


def test_no_verdict_literal_outside_its_home():
    bad = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path == HOME:
                continue
            for line, text in _literals(ast.parse(path.read_text(), str(path))):
                for k in Verdict:
                    if text == k.value or text.startswith((k.value + " (", k.value + ":")):
                        bad.append(f"{path.relative_to(ROOT)}:{line}: {text[:60]!r}")
    assert not bad, "verdict words belong to harness/verdicts.Verdict:\n" + "\n".join(bad)
