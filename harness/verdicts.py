"""The three outcomes of every gate, and the exit codes the commands map them to.

Contract:
- Every gate (lossless greedy / concurrent / engine gates, sampled, the sweep's acceptance audit) ends
  PASS, FAIL or CANNOT TEST. CANNOT TEST means the gate could not collect the evidence a verdict needs:
  a capability the engine lacks (token ids, a tokenizer, logprobs at the divergence, spec counters for
  the audit), or zero testable cells, tokens or prompts. It always names what was missing
  (`CannotTest.capability`, `missing=` in the records) and is never a pass.
- Exit codes of the gate commands: 0 ok (PASS), 1 a check failed (FAIL and its variants: NOT
  SPECULATING, NO DRAFT ACCEPTED, INCOMPLETE), 2 bad usage or input (an option, an engine string), 3
  CANNOT TEST. FAIL wins over CANNOT TEST when a run has both: evidence of a bug is a finding even where
  other parts could not be tested.
- Speculation (`speculation_verdict`): a losslessness PASS needs evidence that the candidate speculated (spec
  counters, per-request draft counts, or streamed chunks that carried several tokens): observed -> PASS;
  evidence that it did not (counters or per-request counts present, zero drafts) -> NOT SPECULATING (exit 1);
  no evidence at all -> CANNOT TEST (`NO_SPEC_EVIDENCE`), unless the user asserts it speculates
  (--assume-speculating) -> `PASS_ASSERTED`, which says so (exit 0).
"""

from __future__ import annotations

from enum import StrEnum


class Verdict(StrEnum):
    """The kinds of verdict. A member is its word (`Verdict.PASS == "PASS"`, so records and reports keep plain
    strings); a verdict may carry a qualifier after its word (`Verdict.PASS.qualified("no rejection tested")`
    -> "PASS (no rejection tested)"), and `Verdict.of` reads the kind back from any such string."""

    PASS = "PASS"
    CANNOT_TEST = "CANNOT TEST"
    NOT_SPECULATING = "NOT SPECULATING"
    NO_DRAFT_ACCEPTED = "NO DRAFT ACCEPTED"
    INCOMPLETE = "INCOMPLETE"
    ERROR = "ERROR"
    FAIL = "FAIL"

    @classmethod
    def of(cls, verdict: str | None) -> Verdict:
        """The kind of a verdict string, qualified or not ("PASS (no rejection tested)" -> PASS, "CANNOT TEST:
        why" -> CANNOT_TEST). An empty or unknown string is ERROR: what nobody can read is no pass."""
        v = str(verdict or "")
        for k in cls:
            if v == k.value or v.startswith((k.value + " (", k.value + ":")):
                return k
        return cls.ERROR

    @property
    def rank(self) -> int:
        """Which kind wins when verdicts combine: FAIL over the other failures (NOT SPECULATING, NO DRAFT
        ACCEPTED, INCOMPLETE, ERROR) over CANNOT TEST over PASS. Evidence of a bug is a finding even where
        other parts could not be tested."""
        return {Verdict.PASS: 0, Verdict.CANNOT_TEST: 1, Verdict.FAIL: 3}.get(self, 2)

    @property
    def exit_code(self) -> int:
        return {Verdict.PASS: EXIT_OK, Verdict.CANNOT_TEST: EXIT_CANNOT_TEST}.get(self, EXIT_FAIL)

    def qualified(self, why: str) -> str:
        """This kind with a qualifier: `Verdict.CANNOT_TEST.qualified("no testable cell")` -> "CANNOT TEST (no
        testable cell)"."""
        return f"{self.value} ({why})"

    def because(self, why: str) -> str:
        """A reason line that opens with this kind: `Verdict.CANNOT_TEST.because("x")` -> "CANNOT TEST: x"."""
        return f"{self.value}: {why}"


PASS = Verdict.PASS
FAIL = Verdict.FAIL
CANNOT_TEST = Verdict.CANNOT_TEST
NOT_SPECULATING = Verdict.NOT_SPECULATING
NO_DRAFT_ACCEPTED = Verdict.NO_DRAFT_ACCEPTED
INCOMPLETE = Verdict.INCOMPLETE
ERROR = Verdict.ERROR
PASS_ASSERTED = PASS.qualified("speculation asserted by the user, not observed")
NO_SPEC_EVIDENCE = ("evidence that the candidate speculated (no spec counters, no per-request draft counts, no "
                    "streamed chunk of several tokens; --assume-speculating if you know it does)")

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_USAGE = 2
EXIT_CANNOT_TEST = 3


class CannotTest(Exception):
    """A gate cannot reach a verdict: `capability` names what the engine (or the run) lacks."""

    def __init__(self, capability: str, detail: str = "") -> None:
        self.capability, self.detail = capability, detail
        super().__init__(f"{capability}: {detail}" if detail else capability)


def is_pass(verdict: str | None) -> bool:
    """Is this verdict (qualified or not) a pass? The one "is it ok" test."""
    return Verdict.of(verdict) is PASS


def is_cannot_test(verdict: str | None) -> bool:
    return Verdict.of(verdict) is CANNOT_TEST


def speculation_verdict(speculating: bool | None, assumed: bool = False) -> str:
    """The verdict of a gate that found nothing wrong, by what it saw of speculation: True (observed) -> PASS,
    False (counted, none) -> NOT SPECULATING, None (no evidence) -> PASS_ASSERTED where the user asserted it
    (`assumed`), else CANNOT TEST."""
    if speculating is None:
        return PASS_ASSERTED if assumed else CANNOT_TEST
    return PASS if speculating else NOT_SPECULATING


def exit_code(verdict: str | None) -> int:
    """The one exit-code map: 0 for PASS (and its qualified forms, e.g. PASS_ASSERTED), 3 for CANNOT TEST (and its
    qualified forms), else 1 (FAIL, NOT SPECULATING, NO DRAFT ACCEPTED, INCOMPLETE, ERROR, anything unreadable)."""
    return Verdict.of(verdict).exit_code


def combine(verdicts: list[str]) -> str:
    """One verdict from several gates: the highest `Verdict.rank` wins (the first such verdict, as given; a
    CANNOT TEST as the plain word); empty -> CANNOT TEST."""
    if not verdicts:
        return CANNOT_TEST
    top = max(verdicts, key=lambda v: Verdict.of(v).rank)
    return CANNOT_TEST if is_cannot_test(top) else top
