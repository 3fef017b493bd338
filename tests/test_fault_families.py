"""A fault's family and expected outcome live on the fault (engine/faults.py) and reach the suites through the
adapter's "faults" capability (`fault_catalogue`): the greedy self-test takes the greedy family, the prefix
self-test the prefix family held to each fault's expectation, and no suite keeps a list of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from specbench.engine.faults import EXPECTS, FAMILIES, FAULT_TYPES, Fault
from specbench.harness.adapters.base import EngineAdapter, FaultInfo, UnsupportedCapability
from specbench.harness.adapters.local import LocalAdapter
from specbench.harness.verdicts import FAIL, PASS
from specbench.suites.lossless import prefix
from specbench.suites.lossless.selftest import greedy_faults


# ---- on the fault -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attr,value", [("family", "vibes"), ("expect", "maybe")])
def test_a_fault_with_an_unknown_family_or_outcome_is_refused(attr: str, value: str) -> None:
    with pytest.raises(TypeError) as e:
        type("Odd", (Fault,), {"name": "odd", "description": "x", attr: value})
    known = {"family": FAMILIES, "expect": EXPECTS}[attr]
    assert f"fault Odd: {attr} {value!r} is invalid: expected one of {', '.join(known)}" == str(e.value)


def test_a_fault_of_known_words_is_taken() -> None:
    odd = type("Odd", (Fault,), {"name": "odd", "description": "x", "family": "prefix", "expect": "fallback"})
    assert (odd.family, odd.expect) == ("prefix", "fallback")
    assert (type("Plain", (Fault,), {"name": "plain", "description": "y"}).family, Fault.expect) == ("greedy", "fail")


def test_the_sampled_selftest_cases_are_the_sampling_family() -> None:
    """suites/sampled/selftest.py keeps its own tuple of cases (its CLI's default): it must be the family."""
    from specbench.suites.sampled.selftest import FAULT_CASES

    assert set(FAULT_CASES) == {n for n, f in FAULT_TYPES.items() if f.family == "sampling"}


# ---- through the adapter ----------------------------------------------------------------------------------------
def test_the_local_adapter_reports_each_fault_as_the_engine_defines_it() -> None:
    ad = LocalAdapter.__new__(LocalAdapter)  # the catalogue needs no engine: skip building one
    cat = ad.fault_catalogue()
    assert list(cat) == list(FAULT_TYPES)
    assert all(cat[n] == FaultInfo(f.description, f.family, f.expect) for n, f in FAULT_TYPES.items())
    assert {n: cat[n].expect for n in ("register_before_forward", "no_publish_on_finish")} == {
        "register_before_forward": "fail", "no_publish_on_finish": "fallback"}
    # armable: every family but the drafter variants, which no gate can catch
    assert set(ad.armable_faults()) == {n for n, i in cat.items() if i.family != "draft_variant"}
    assert {"selector_skipped", "causal_draft"} <= set(cat) - set(ad.armable_faults())


class Bare(EngineAdapter):
    """An engine without the "faults" capability (the base's declining defaults)."""

    kind = "fake"

    async def generate_one(self, req):  # the gate is replaced in these tests: no request is sent
        raise AssertionError("no request expected")

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind}


class Catalogued(Bare):
    """An engine that names the faults it is given (the "faults" capability) and records what gets armed."""

    def __init__(self, catalogue: dict[str, FaultInfo], faults: tuple[str, ...] = (), armed: list | None = None):
        super().__init__(f"fake[{'+'.join(faults)}]" if faults else "fake")
        self.catalogue, self.faults = catalogue, faults
        self.armed = armed if armed is not None else []

    def fault_catalogue(self) -> dict[str, FaultInfo]:
        return dict(self.catalogue)

    def with_faults(self, faults: Sequence[str], name: str | None = None) -> Catalogued:
        self.armed.append(tuple(faults))
        return Catalogued(self.catalogue, tuple(faults), self.armed)


CATALOGUE = {"kv_offset": FaultInfo("k", "greedy"), "stuck": FaultInfo("s", "prefix"),
             "slow": FaultInfo("l", "prefix", "fallback"), "biased_accept": FaultInfo("b", "sampling"),
             "selector_skipped": FaultInfo("v", "draft_variant", "acceptance")}


def test_greedy_faults_are_the_greedy_family_whatever_the_names() -> None:
    assert greedy_faults(Catalogued(CATALOGUE)) == {"kv_offset": "k"}
    assert greedy_faults(Catalogued({"new_bug": FaultInfo("n", "greedy")})) == {"new_bug": "n"}
    assert greedy_faults(Catalogued({"kv_offset": FaultInfo("k", "prefix")})) == {}


def test_an_adapter_without_faults_declines_both() -> None:
    ad = Bare("plain")
    for call in (ad.fault_catalogue, ad.armable_faults):
        with pytest.raises(UnsupportedCapability):
            call()


def _outcome(verdict: str, fell_back: bool) -> prefix.PrefixOutcome:
    case = prefix.Case("c", "turn", 16, 0, [1], 4, drafted="fell back" if fell_back else "drafted")
    return prefix.PrefixOutcome({}, "flush", 0.1, 0.0, 0.1, {}, [case], verdict=verdict)


def _selftest(monkeypatch, catalogue: dict[str, FaultInfo], behaviour: dict[str, tuple[str, bool]]):
    """run_prefix_selftest on a fake engine whose gate outcome per armed fault is `behaviour` (clean: PASS)."""

    async def gate(ad, conversations, opts=None):
        return _outcome(*behaviour.get("+".join(ad.faults), (PASS, False)))

    monkeypatch.setattr(prefix, "run_prefix_gate", gate)
    ad = Catalogued(catalogue)
    return asyncio.run(prefix.run_prefix_selftest(ad, [], repeat=2)), ad.armed


def test_prefix_selftest_takes_the_prefix_family_and_its_expectations(monkeypatch) -> None:
    st, armed = _selftest(monkeypatch, CATALOGUE, {"stuck": (FAIL, False), "slow": (FAIL, True)})
    assert armed == [(), ("stuck",), ("slow",)]  # one more clean engine, then the prefix faults alone
    assert list(st.faults) == ["stuck", "slow"] and st.expect == {"stuck": "fail", "slow": "fallback"}
    assert st.ok and st.problems() == []


def test_prefix_selftest_fails_a_fault_that_misses_its_expectation(monkeypatch) -> None:
    # "slow" is expected to fall back and does not; "stuck" is expected to FAIL and passes
    st, _ = _selftest(monkeypatch, CATALOGUE, {"stuck": (PASS, False), "slow": (PASS, False)})
    assert not st.ok and st.problems() == ["stuck: PASS, expected FAIL",
                                           "slow: 0 warm turns fell back, PASS (expected fallbacks, FAIL)"]
    # the same outcomes judged by the fault's own word: an engine that says "stuck" only falls back
    swapped = dict(CATALOGUE, stuck=FaultInfo("s", "prefix", "fallback"), slow=FaultInfo("l", "prefix", "fail"))
    st, _ = _selftest(monkeypatch, swapped, {"stuck": (FAIL, True), "slow": (FAIL, False)})
    assert st.ok and st.expect == {"stuck": "fallback", "slow": "fail"}
