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

PASS = "PASS"
FAIL = "FAIL"
CANNOT_TEST = "CANNOT TEST"

NOT_SPECULATING = "NOT SPECULATING"
PASS_ASSERTED = "PASS (speculation asserted by the user, not observed)"
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


def is_cannot_test(verdict: str | None) -> bool:
    return bool(verdict) and str(verdict).startswith(CANNOT_TEST)


def speculation_verdict(speculating: bool | None, assumed: bool = False) -> str:
    """The verdict of a gate that found nothing wrong, by what it saw of speculation: True (observed) -> PASS,
    False (counted, none) -> NOT SPECULATING, None (no evidence) -> PASS_ASSERTED where the user asserted it
    (`assumed`), else CANNOT TEST."""
    if speculating is None:
        return PASS_ASSERTED if assumed else CANNOT_TEST
    return PASS if speculating else NOT_SPECULATING


def exit_code(verdict: str | None) -> int:
    """The one exit-code map: 0 for PASS (and its qualified forms, e.g. PASS_ASSERTED), 3 for CANNOT TEST (and its
    qualified forms), else 1 (FAIL, NOT SPECULATING, NO DRAFT ACCEPTED, INCOMPLETE, ERROR)."""
    v = str(verdict or "")
    if v.startswith(PASS):
        return EXIT_OK
    if v.startswith(CANNOT_TEST):
        return EXIT_CANNOT_TEST
    return EXIT_FAIL


def combine(verdicts: list[str]) -> str:
    """One verdict from several gates: FAIL-like beats CANNOT TEST beats PASS; empty -> CANNOT TEST."""
    if not verdicts:
        return CANNOT_TEST
    bad = [v for v in verdicts if exit_code(v) == EXIT_FAIL]
    if bad:
        return FAIL if any(v == FAIL for v in bad) else bad[0]
    if any(is_cannot_test(v) for v in verdicts):
        return CANNOT_TEST
    return verdicts[0]
