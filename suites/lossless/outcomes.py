"""The greedy gate's outcome records: `Prompt`, `Divergence`, `PromptCheck`, `GateRun` and its verdict.

Contract:
- `Prompt` is one prompt's token ids (tokenized once, by the baseline: greedy.tokenize_prompts), or a chat
  prompt (`messages`; its `ids` are the rendered prompt ids the endpoints report, filled in by the gate).
- `Divergence` is one position where the candidate left its judging baseline: a token flip judged by the
  regret rule (regret.py), or a length mismatch ("past_stop" / "early_stop", always a FAIL); `ok` when the
  judgement is benign and the candidate's re-scoring did not disagree (`rescore_fail`).
- `PromptCheck` is one prompt's outcome (identical | flip | fail | error | untestable) with its divergences.
- `GateRun` is one gate's outcome: per-prompt checks, run checks (checks.py) and speculation statistics;
  `GateRun.verdict` is FAIL, CANNOT TEST, or (for a gate judged on speculation, `require_spec`)
  harness/verdicts.speculation_verdict of its evidence: PASS, NOT SPECULATING, or PASS_ASSERTED where no evidence
  was found and the user asserted speculation; a gate not judged on speculation passes as PASS. No verdict
  without evidence: greedy.py builds them (check_output, finish_run) and re-exports every name here.
- `GateRun.missing` gives each reason a CANNOT TEST has, and only true ones: where the candidate returned no
  token at all (every ok output empty, nothing compared, nothing failed) that is the one reason (what else
  could not be tested follows from it); else the gate's own reasons (`cannot_test`), the capabilities its
  untestable prompts lacked (a reason the gate already gives is not repeated), "no prompt was tested" only where
  no other reason says why, and, for a gate judged on speculation, NO_SPEC_EVIDENCE where nothing showed it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specbench.harness.adapters.base import GenResult
from specbench.harness.verdicts import CANNOT_TEST, FAIL, NO_SPEC_EVIDENCE, PASS, speculation_verdict

from .checks import AcceptanceComparison, AcceptanceEvidence, Check
from .regret import PickJudgement

NO_OUTPUT = "a token to compare: the candidate returned no token (every output empty)"


@dataclass
class Prompt:
    pid: str
    ids: list[int]  # chat prompts: the rendered prompt's ids the endpoints reported ([] until known / if none)
    text: str = ""
    messages: list[dict] | None = None  # set: a chat prompt (--endpoint-type chat), rendered by the server

    @property
    def chat(self) -> bool:
        return self.messages is not None


@dataclass
class Divergence:
    position: int  # index into the candidate's output
    kind: str  # "token" | "past_stop" | "early_stop"
    pick: int | None
    baseline_token: int | None
    anchor: int  # the candidate prefix length the judging baseline was generated from
    judgement: PickJudgement | None = None
    rescore: dict | None = None
    dist_source: str = "generation"  # the baseline distribution: "generation" | "regenerated" | "teacher-forced"
    rescore_fail: str | None = None  # the re-scoring disagreed beyond the tolerance (a FAIL): why

    @property
    def ok(self) -> bool:
        return self.judgement is not None and self.judgement.ok and not self.rescore_fail

    def describe(self) -> str:
        if self.kind == "past_stop":
            return f"the baseline stopped at position {self.position}; the candidate emitted token {self.pick} past it"
        if self.kind == "early_stop":
            return f"the candidate stopped at position {self.position}; the baseline continued with {self.baseline_token}"
        if self.judgement is None:  # no baseline distribution there (an untestable prompt)
            return (f"position {self.position}: pick {self.pick} vs baseline {self.baseline_token}, not judged "
                    f"(no baseline distribution: {self.dist_source})")
        if self.rescore_fail:
            return f"position {self.position}: FAIL (rescore): {self.rescore_fail}"
        return f"position {self.position}: {self.judgement.describe()}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["judgement"] = self.judgement.to_dict() if self.judgement else None
        d["describe"] = self.describe()
        return d


@dataclass
class PromptCheck:
    pid: str
    prompt_len: int
    max_tokens: int
    status: str = "identical"  # identical | flip | fail | error | untestable
    candidate_tokens: int = 0
    tokens_compared: int = 0
    reanchors: int = 0
    complete: bool = True
    reason: str = ""
    divergences: list[Divergence] = field(default_factory=list)
    spec: dict | None = None
    missing: str | None = None  # untestable: the capability that was missing

    @property
    def ok(self) -> bool:
        return self.status in ("identical", "flip")

    @property
    def untestable(self) -> bool:
        return self.status == "untestable"

    @property
    def first_divergence(self) -> int | None:
        return self.divergences[0].position if self.divergences else None

    @property
    def max_regret(self) -> float | None:
        vals = [v for d in self.divergences if d.judgement and (v := d.judgement.regret_or_bound) is not None]
        return max(vals) if vals else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["divergences"] = [x.to_dict() for x in self.divergences]
        d.update(ok=self.ok, first_divergence=self.first_divergence, max_regret=self.max_regret)
        return d


@dataclass
class GateRun:
    """One gate's outcome: per-prompt checks, run checks, and what speculation did meanwhile."""

    name: str
    prompts: list[PromptCheck]
    stats: AcceptanceEvidence
    checks: list[Check] = field(default_factory=list)
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    results: list[GenResult] = field(default_factory=list, repr=False)  # the candidate's, not serialized
    # Scenario gates with a handful of short requests report speculation but are not judged on it:
    # three drafts that happen to miss must not turn a correct engine's headroom check into an alarm.
    require_spec: bool = True
    rule: dict = field(default_factory=dict)  # the tolerance applied (GreedyGateOptions.rule_dict)
    cannot_test: list[str] = field(default_factory=list)  # evidence a gate-level check could not collect
    delta: dict | None = None  # the candidate's spec counters delta around the gate's requests
    acceptance: AcceptanceComparison | None = None  # the concurrent gate: acceptance at cN vs c1
    evidence: dict = field(default_factory=dict)  # gate-specific measurements (eos-in-run: stops inside runs)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.ok and not c.skipped]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts) and not self.failed_checks

    @property
    def failed(self) -> bool:
        return any(not p.ok and not p.untestable for p in self.prompts) or bool(self.failed_checks)

    @property
    def no_output(self) -> bool:
        """The candidate returned no token at all: every ok result empty (no ids, no text) and nothing compared."""
        ok = [r for r in self.results if r.ok]
        return (bool(ok) and all(not r.output_ids and not r.text for r in ok)
                and not sum(p.tokens_compared for p in self.prompts))

    @property
    def missing(self) -> list[str]:
        """Why the gate cannot reach a verdict (empty when it can): each true reason, once (module docstring)."""
        if self.no_output:
            return [NO_OUTPUT]
        out = list(dict.fromkeys(self.cannot_test))
        for m in sorted({p.missing or "?" for p in self.prompts if p.untestable}):
            if not any(c == m or c.startswith(m + ":") for c in out):
                out.append(m)
        if not self.prompts and not out:
            out.append("no prompt was tested")
        elif not out and not sum(p.tokens_compared for p in self.prompts):
            out.append("no token was compared (every output empty)")
        if (self.require_spec and self.stats.speculating is None and not self.stats.assumed
                and self.stats.source != "not measured"):
            out.append(NO_SPEC_EVIDENCE)
        return out

    @property
    def verdict(self) -> str:
        if self.failed:
            return FAIL
        if self.missing:
            return CANNOT_TEST
        if not self.require_spec:
            return PASS
        return speculation_verdict(self.stats.speculating, self.stats.assumed)

    def to_dict(self) -> dict:
        return {"name": self.name, "verdict": self.verdict, "ok": self.ok, "wall_s": self.wall_s,
                "require_spec": self.require_spec, "missing": self.missing, "rule": dict(self.rule),
                "stats": self.stats.to_dict(), "checks": [c.to_dict() for c in self.checks],
                "notes": list(self.notes), "prompts": [p.to_dict() for p in self.prompts],
                "acceptance": self.acceptance.to_dict() if self.acceptance is not None else None,
                "evidence": dict(self.evidence)}
