"""The lossless gate registry (suites/lossless/registry.py) is the one list: the suite's engine gates, the
self-test's gates, the CLI's --engine-gates help and docs/lossless.md's gate table follow it, and every greedy
fault of the engine is claimed by some gate."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from specbench.suites.lossless import registry
from specbench.suites.lossless.registry import ENGINE_GATES, GATES, REGISTRY, SELFTEST_GATES, GateSpec

ROOT = Path(__file__).resolve().parents[1]


# ---- the CLI help (a string built at import of cli/lossless.py, which imports no suite) ------------------------
def _help_gates(text: str) -> list[str]:
    """The gates a --engine-gates help names: the parenthesized list, first word of each item."""
    m = re.search(r"\(([^)]*)\)", text)
    return [item.split()[0] for item in m.group(1).split(", ")] if m else []


def test_engine_gates_help_names_exactly_the_registry() -> None:
    from specbench.cli.lossless import lossless

    text = inspect.signature(lossless).parameters["engine_gates"].default.help
    assert _help_gates(text) == list(GATES)


def test_help_check_sees_a_missing_or_extra_gate() -> None:
    names = list(GATES)
    assert _help_gates(f"The engine gates ({', '.join(names)}). Default: on.") == names
    assert _help_gates(f"The engine gates ({', '.join(names[:-1])}).") != names  # one left out
    assert _help_gates(f"The engine gates ({', '.join([*names, 'vibes'])}).") != names  # one not registered
    assert _help_gates(f"The engine gates ({', '.join(reversed(names))}).") != names  # not the run order


# ---- docs/lossless.md's gate table -----------------------------------------------------------------------------
def _undocumented(doc: str) -> list[str]:
    """Registered gates that no row of the "## Gates" table names in its first cell (by name, or the flag of
    that name that turns it on: `--batch-invariance`)."""
    section = doc.split("\n## Gates\n", 1)[1].split("\n## ", 1)[0] if "\n## Gates\n" in doc else ""
    firsts = [line.strip("|").split("|")[0] for line in section.splitlines() if line.startswith("| ")]
    return [s.name for s in REGISTRY if not any(re.search(rf"(?:(?<![\w-])|(?<=--)){re.escape(s.name)}(?![\w-])", c)
                                                for c in firsts)]


def test_docs_gate_table_names_every_registered_gate() -> None:
    assert _undocumented((ROOT / "docs" / "lossless.md").read_text(encoding="utf-8")) == []


def test_docs_check_sees_a_missing_row() -> None:
    doc = (ROOT / "docs" / "lossless.md").read_text(encoding="utf-8")
    cut = "\n".join(line for line in doc.splitlines() if not line.startswith("| min-tokens (engine gate)"))
    assert _undocumented(cut) == ["min-tokens"]
    assert _undocumented(doc.replace("\n## Gates\n", "\n## Other\n")) == [s.name for s in REGISTRY]


# ---- the registry's own shape ---------------------------------------------------------------------------------
def test_the_suite_and_the_selftest_read_the_registry() -> None:
    from specbench.suites.lossless import selftest

    assert list(GATES) == [s.name for s in ENGINE_GATES] and all(GATES[s.name] is s.run for s in ENGINE_GATES)
    assert selftest.GATE_NAMES == tuple(s.name for s in SELFTEST_GATES)
    assert [s.name for s in ENGINE_GATES if s.fresh] == ["short-then-long"]  # first, on a fresh engine
    assert REGISTRY[0].fresh and len({s.name for s in REGISTRY}) == len(REGISTRY)
    assert {s.name for s in REGISTRY if s.advisory} == {"concurrent", *GATES}  # what LosslessConfig accepts


@pytest.mark.parametrize("field,value", [("needs", ("token_ids", "telepathy")), ("uses", ("vibes",)),
                                         ("when", "sometimes"), ("kind", "misc")])
def test_a_record_with_an_unknown_word_is_refused(field: str, value) -> None:
    kw = {"needs": ("token_ids",), "uses": (), "when": "default", "kind": "engine", field: value}
    with pytest.raises(ValueError) as e:
        GateSpec("x", lambda: None, "a gate", kw["kind"], kw["when"], kw["needs"], kw["uses"])
    bad = value if isinstance(value, str) else value[-1]
    assert f"gate 'x': {field} {bad} is invalid: expected any of" in str(e.value)
    known = {"needs": registry.NEEDS, "uses": registry.NEEDS, "when": registry.WHEN, "kind": registry.KINDS}[field]
    assert all(w in str(e.value) for w in known)


def test_a_record_of_known_words_is_taken() -> None:
    s = GateSpec("x", lambda: None, "a gate", "engine", "asked", ("token_ids", "logprobs"), ("geometry",))
    assert not s.advisory and s.needs == ("token_ids", "logprobs")


# ---- the faults each gate is meant to catch -------------------------------------------------------------------
def _claims(specs, faults: dict[str, str]) -> list[str]:
    """Problems: a claimed fault the engine does not name as greedy, or a greedy fault no gate claims."""
    claimed = {f for s in specs for f in s.catches}
    return ([f"{f}: not a greedy fault" for f in sorted(claimed - set(faults))]
            + [f"{f}: no gate claims it" for f in faults if f not in claimed])


def _greedy_faults() -> dict[str, str]:
    from specbench.engine.faults import FAULT_TYPES

    return {n: f.description for n, f in FAULT_TYPES.items() if f.family == "greedy"}


def test_every_greedy_fault_is_claimed_by_a_gate() -> None:
    assert _claims(REGISTRY, _greedy_faults()) == []


def test_claims_check_sees_an_unclaimed_and_an_unknown_fault() -> None:
    from dataclasses import replace

    faults = _greedy_faults()
    dropped = [replace(s, catches=tuple(f for f in s.catches if f != "stale_shape")) for s in REGISTRY]
    assert _claims(dropped, faults) == ["stale_shape: no gate claims it"]
    extra = [replace(REGISTRY[0], catches=(*REGISTRY[0].catches, "biased_accept")), *REGISTRY[1:]]
    assert _claims(extra, faults) == ["biased_accept: not a greedy fault"]  # a sampling fault: not a greedy gate's
