"""The `lossless` suite: the greedy gate, the concurrent gate and the engine gates (each switchable), one verdict.

Contract:
- `run_lossless(baseline, candidate, cfg, run=None, log=print)` tokenizes the prompt set once (the
  baseline's tokenizer), runs the greedy gate (`cfg.concurrency` candidate requests at a time), then the
  concurrent heterogeneous gate (`cfg.concurrent`) and the engine gates (`cfg.engine_gates`; registry.py's
  order, short-then-long first, while the engine is fresh), and returns a `LosslessOutcome`.
- With a results `Run`, every per-prompt check is written as it completes ("checks" records), every
  candidate request at the end of its gate ("requests", arm "candidate"), and one "gates" record per gate;
  the run record's summary gets the verdict. Reports are pure functions of the outcome (report.py).
- Progress (`progress`, cli/progress.py RunProgress): prompts compared, planned for the gates that judge
  prompt by prompt (greedy; concurrent with `cfg.concurrent`), one tick per prompt judged; every gate is
  named as it starts, the engine, rate and batch gates without a count of their own.
- Verdict: FAIL if any gate fails; else NOT SPECULATING if the greedy gate
  saw no speculation (zero drafts or a mean accepted length <= min_accept_len); else CANNOT TEST if a gate
  could not collect its evidence (or the prompts could not be tokenized at all: then no gate runs), naming
  what was missing, which includes a greedy gate that saw no evidence that the candidate speculated (no spec
  counters, no per-request draft counts, no streamed chunk of several tokens); else the greedy gate's PASS, or
  "PASS (speculation asserted by the user, not observed)" where nothing showed speculation and
  `assume_speculating` (--assume-speculating) asserts it. `exit_code` maps it (harness/verdicts.py: 0 PASS,
  1 FAIL / NOT SPECULATING, 3 CANNOT TEST).
- `cfg.advisory` names the gates that run because they are on by default (the CLI without --quick): their
  CANNOT TEST does not decide the verdict but is listed (`not_tested`, the notes, the reports' "could not
  run" and the VERDICT line); their FAIL does. The greedy gate is never advisory.
- `checks_not_run()` lists, per gate, every check that could not run and why (skipped run checks,
  re-scoring the candidate could not do, untestable prompts, the engines' missing capabilities); the
  reports print it beside the verdict.
- The tolerance: `margin_tol` None means the user typed none: then strict mode (regret.STRICT_FP32_TOL) in
  every gate when both engines run fp32, else the bf16 / fp16 margin (regret.MARGIN_TOL); a typed margin is
  honoured as typed, fp32 or not (`strict` True / False forces strict or margin; --strict with a typed margin is
  bad input). greedy.resolve_rule decides; the rule (mode, tol, why) is in the outcome's notes, in `rule` of the
  summary and of every "gates" record, in `tolerance` of every "checks" record, on the console's VERDICT line
  and in the reports' per-gate table.
- Acceptance (two-sided, checks.check_acceptance: within 10% of the reference's excess over 1, either way) on
  the greedy gate, against `expect_accept_len` when given, else against the reference recorded in the results
  store for the same fingerprint (reference.py: engine, drafter, prompts, max_tokens, concurrency), unless
  `accept_reference` is off. A run that PASSes, on an engine with no fault armed and with a results run
  open, records its acceptance as the reference when none exists (or always with `record_reference`);
  `reference` in the summary says what was used and what was written.
- `rate_test` adds the "divergence-rate" gate (greedy + concurrent divergences per compared token against
  the baseline's own batch noise on the same prompts); `batch_invariance` the "batch cN spec-off/on" gates
  and "batch-rate" (batch.py; `batch_levels`, `batch_prompts`, `rate_alpha`, `rate_detect`).
- `endpoint_type="chat"`: every prompt is one user message sent to both arms as the same chat request
  (/v1/chat/completions; the server applies its chat template), nothing is tokenized here, and the greedy
  and concurrent gates judge the token ids the endpoints report (greedy.py's chat contract). The engine
  gates, the rate test and the batch gates send token-id requests by construction: with chat they are
  refused as bad input (LosslessError naming the option), never run on a different request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specbench.harness.adapters.base import EngineAdapter, refuse_synthetic
from specbench.harness.verdicts import (
    CANNOT_TEST,
    ERROR,
    FAIL,
    NOT_SPECULATING,
    PASS,
    CannotTest,
    Verdict,
    combine,
    exit_code,
    is_pass,
)

from . import reference as accept_ref
from .batch import BatchOptions, load_batch_prompts, run_batch_invariance, run_rate_gate
from .checks import check_acceptance
from .concurrent import run_concurrent
from .greedy import (
    GateRun,
    GreedyGateOptions,
    LosslessError,
    Prompt,
    PromptCheck,
    resolve_rule,
    run_greedy,
    tokenize_prompts,
)
from .prompts import load_prompts
from .registry import ENGINE_GATES, GATES
from .regret import MARGIN_TOL, STRICT_FP32_TOL

SUITE_VERSION = "1"
ENDPOINT_TYPES = ("completions", "chat")  # the sweep's --endpoint-type vocabulary


@dataclass(frozen=True)
class LosslessConfig:
    margin_tol: float | None = None  # None: not typed (MARGIN_TOL, or strict mode in fp32); a number: honoured
    top_k: int = 20
    dataset: str = "gsm8k"
    num_prompts: int = 8
    max_tokens: int = 64
    max_divergences: int = 8
    rescore: bool = True
    concurrency: int = 1
    concurrent: bool = False
    engine_gates: bool = False
    min_accept_len: float = 1.05
    expect_accept_len: float | None = None
    max_prompt_chars: int = 1000
    rate_test: bool = False  # the divergence-rate gate against the baseline's batch noise (batch.py)
    batch_invariance: bool = False  # the batch-invariance gates, both arms (batch.py)
    batch_levels: tuple[int, ...] = (1, 8, 32)
    batch_prompts: int | None = None  # default: the largest batch level
    rate_alpha: float = 0.01
    rate_detect: float = 5.0  # per 1,000 tokens: the rate excess the rate test must be able to see
    strict: bool | None = None  # None: strict mode when both engines run fp32; True / False: forced
    strict_tol: float = STRICT_FP32_TOL
    accept_reference: bool = True  # hold acceptance against (and record) the results store's reference
    record_reference: bool = False  # replace the stored reference with this run's acceptance (when it PASSes)
    results: str | None = None  # the results directory the references live in (None: $SPECBENCH_RESULTS / ./results)
    endpoint_type: str = "completions"  # "chat": the prompts as chat messages, rendered by the server
    # Gates run because they are on by default, not because they were asked for (`specbench lossless` without
    # --quick, --concurrent or --engine-gates): a FAIL among them fails the run as any gate's does, but a CANNOT TEST
    # (an engine that cannot take min_tokens, a remote engine without the model geometry) is reported beside the
    # verdict (`LosslessOutcome.not_tested`) instead of deciding it. Names: "concurrent" and the engine gates'.
    advisory: tuple[str, ...] = ()
    assume_speculating: bool = False  # the user asserts the candidate speculates (no evidence: PASS_ASSERTED)
    replay: str = ""  # --replay-drafter (gates/accept_trace.py ReplaySpec)

    def __post_init__(self) -> None:
        for name, lo in (("num_prompts", 1), ("max_tokens", 1), ("max_divergences", 1), ("concurrency", 1),
                         ("top_k", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise LosslessError(f"--{name.replace('_', '-')} {v!r} is invalid: expected an integer >= {lo}")
        if self.margin_tol is not None and not 0 <= self.margin_tol < 50:
            raise LosslessError(f"--margin-tol {self.margin_tol!r} is invalid: expected nats in [0, 50)")
        if self.margin_tol is not None and self.strict is True:
            raise LosslessError(f"--margin-tol {self.margin_tol:g} and --strict contradict each other: --strict judges "
                                "every gate by --strict-tol (fp32 exactness); give one of them")
        if self.top_k > 20:
            raise LosslessError(f"top_k={self.top_k} is invalid: engines return at most 20 logprobs")
        if not 0 < self.strict_tol < 50:
            raise LosslessError(f"--strict-tol {self.strict_tol!r} is invalid: expected nats in (0, 50)")
        if self.endpoint_type not in ENDPOINT_TYPES:
            raise LosslessError(f"--endpoint-type {self.endpoint_type!r} is invalid: expected completions or chat")
        bad = sorted(set(self.advisory) - {"concurrent", *GATES})
        if bad:
            raise LosslessError(f"advisory gates {bad} are invalid: expected concurrent or {', '.join(GATES)}")
        if self.endpoint_type == "chat":
            for flag, on in (("--engine-gates", self.engine_gates), ("--rate-test", self.rate_test),
                             ("--batch-invariance", self.batch_invariance)):
                if on:
                    raise LosslessError(f"{flag} is not available with --endpoint-type chat: its requests are "
                                        "token-id prompts by construction; run it with --endpoint-type completions")
        self.batch_options  # noqa: B018  (validates the batch / rate options)
        if self.replay:
            from .gates.accept_trace import ReplaySpec  # noqa: PLC0415

            ReplaySpec.parse(self.replay)  # a bad --replay-drafter is refused before any engine starts

    @property
    def batch_options(self) -> BatchOptions:
        return BatchOptions(tuple(self.batch_levels), self.batch_prompts, self.rate_alpha, self.rate_detect)

    @property
    def gate_options(self) -> GreedyGateOptions:
        return GreedyGateOptions(MARGIN_TOL if self.margin_tol is None else self.margin_tol, self.top_k,
                                 self.max_divergences, self.rescore, self.min_accept_len, strict=self.strict,
                                 strict_tol=self.strict_tol, margin_given=self.margin_tol is not None,
                                 assume_speculating=self.assume_speculating, replay=self.replay)


@dataclass
class LosslessOutcome:
    gates: list[GateRun]
    engines: dict[str, dict]
    config: dict
    notes: list[str] = field(default_factory=list)
    run_id: str | None = None
    wall_s: float = 0.0
    cannot_test: str | None = None  # why no gate could run at all (e.g. nothing tokenizes)
    rule: dict = field(default_factory=dict)  # the tolerance every gate applied (GreedyGateOptions.rule_dict)
    reference: dict = field(default_factory=dict)  # the acceptance reference used / recorded (reference.py)

    advisory: tuple[str, ...] = ()  # gates on by default, not asked for (LosslessConfig.advisory)

    def _advisory(self, g: GateRun) -> bool:
        return g.name in self.advisory and g is not (self.gates[0] if self.gates else None)

    @property
    def verdict(self) -> str:
        """The gates' verdicts combined (harness/verdicts.combine: FAIL over the other failures over CANNOT TEST
        over PASS), the main gate's first: a gate's ERROR counts as a FAIL; an advisory gate's CANNOT TEST is
        reported beside the verdict (`not_tested`), not deciding it; only the main gate is judged on speculation
        (NOT SPECULATING elsewhere does not decide); no gate at all, or `cannot_test`, is CANNOT TEST."""
        deciding: list[str] = []
        for i, g in enumerate(self.gates):
            kind = Verdict.of(g.verdict)
            if (kind is CANNOT_TEST and self._advisory(g)) or (kind is NOT_SPECULATING and i):
                continue
            deciding.append(FAIL if kind is ERROR else g.verdict)
        if self.cannot_test:
            deciding.append(CANNOT_TEST)
        return combine(deciding)

    @property
    def not_tested(self) -> list[str]:
        """The gates on by default (not asked for) that could not collect their evidence, each with what was
        missing: reported beside the verdict, not deciding it (LosslessConfig.advisory)."""
        return [f"{g.name}: {m}" for g in self.gates if self._advisory(g) and g.verdict == CANNOT_TEST
                for m in (g.missing or ["?"])]

    @property
    def ok(self) -> bool:
        """Exit status 0? Only a PASS (plain, or with speculation asserted by the user) is ok."""
        return is_pass(self.verdict)

    @property
    def exit_code(self) -> int:
        return exit_code(self.verdict)

    @property
    def missing(self) -> list[str]:
        out = [self.cannot_test] if self.cannot_test else []
        if not self.gates and not out:
            out.append("no gate ran")
        return out + [f"{g.name}: {m}" for g in self.gates if not self._advisory(g) for m in g.missing]

    def checks_not_run(self) -> list[str]:
        """Every check that could not run, and why (for the reports)."""
        out = list(self.missing) + [f"{m} (on by default: not deciding the verdict)" for m in self.not_tested]
        for g in self.gates:
            out += [f"{g.name}: {c.name} check skipped: {c.detail}" for c in g.checks if c.skipped]
            if g.require_spec and g.stats.speculating is None and g.stats.assumed:  # else in `missing`
                out.append(f"{g.name}: speculation check: {g.stats.describe()}")
            rs = sorted({str((d.rescore or {}).get("status")) for p in g.prompts for d in p.divergences
                         if d.rescore and d.rescore.get("status") != "ok"})
            out += [f"{g.name}: candidate re-scoring: {r}" for r in rs]
            srcs = sorted({d.dist_source for p in g.prompts for d in p.divergences if d.dist_source != "generation"})
            out += [f"{g.name}: baseline distribution at some divergence from {x} (its generation's logprobs were "
                    "missing there)" for x in srcs if x != "none"]
        for arm, d in self.engines.items():
            caps = d.get("capabilities") if isinstance(d, dict) else None
            if isinstance(caps, dict) and caps.get("missing"):
                out.append(f"{arm} ({caps.get('dialect')}) lacks: {', '.join(caps['missing'])}")
        return out

    def summary(self) -> dict:
        g0 = self.gates[0] if self.gates else None
        return {"verdict": self.verdict, "missing": self.missing, "not_tested": self.not_tested,
                "checks_not_run": self.checks_not_run(),
                "gates": {g.name: g.verdict for g in self.gates},
                "prompts": len(g0.prompts) if g0 else 0,
                "failed_prompts": sum(not p.ok and not p.untestable for g in self.gates for p in g.prompts),
                "untestable_prompts": sum(p.untestable for g in self.gates for p in g.prompts),
                "flips": sum(len(p.divergences) for g in self.gates for p in g.prompts if p.ok),
                "mean_accept_len": g0.stats.mean_accept_len if g0 else None, "rule": dict(self.rule),
                "reference": dict(self.reference), "wall_s": self.wall_s}

    def to_dict(self) -> dict:
        return {"suite": "lossless", "suite_version": SUITE_VERSION, "run_id": self.run_id, "verdict": self.verdict,
                "summary": self.summary(), "config": self.config, "engines": self.engines, "notes": self.notes,
                "gates": [g.to_dict() for g in self.gates]}


def recorded_acceptance(describe: dict) -> float | None:
    """The mean accepted length a fixture build recorded beside its drafter (BUILD.json), if any."""
    given = describe.get("config")
    cfg = given if isinstance(given, dict) else {}
    draft = cfg.get("draft")
    if not draft:
        return None
    try:
        info = json.loads((Path(str(draft)).parent / "BUILD.json").read_text())
        return float(info["acceptance"]["mean_accept_len"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record(run, gate: GateRun) -> None:
    if run is None:
        return
    for i, r in enumerate(gate.results):
        run.add_result(r, arm="candidate", idx=i, item_id=f"{gate.name}/{r.rid}")
    d = gate.to_dict()
    d.pop("prompts")
    run.write("gates", d)


async def run_lossless(baseline: EngineAdapter, candidate: EngineAdapter, cfg: LosslessConfig, run=None,
                       log: Callable[[str], None] | None = None, progress: Any = None) -> LosslessOutcome:
    """`progress` (cli/progress.py RunProgress, or None) counts prompts compared: it is planned the prompts of
    the gates that compare prompt by prompt (greedy, and concurrent when on), hears every gate by name as it
    starts (the others with no count) and advances once per prompt judged."""
    t0 = time.perf_counter()
    say = log or (lambda s: None)
    opts = resolve_rule(cfg.gate_options, baseline, candidate)
    texts = load_prompts(cfg.dataset, cfg.num_prompts, cfg.max_prompt_chars)
    engines = {"baseline": baseline.describe(), "candidate": candidate.describe()}  # with the capability records
    refuse_synthetic(engines, "the lossless gates", LosslessError)
    try:
        if cfg.endpoint_type == "chat":  # the server renders (and tokenizes) each chat request itself
            prompts = [Prompt(pid, [], text, messages=[{"role": "user", "content": text}]) for pid, text in texts]
            notes = ["--endpoint-type chat: each prompt is one user message, sent to both arms as the same "
                     "/v1/chat/completions request; the server's chat template renders it, and the gate judges "
                     "the token ids the endpoints report (prompt_token_ids / token_ids, logprobs with ids)"]
        else:
            prompts, notes = await tokenize_prompts(baseline, candidate, texts)
    except CannotTest as e:
        out = LosslessOutcome([], engines, asdict(cfg), [str(e)], cannot_test=f"{e.capability}: {e.detail}",
                              advisory=tuple(cfg.advisory))
        out.run_id = run.run_id if run is not None else None
        out.wall_s = time.perf_counter() - t0
        say(f"[lossless] CANNOT TEST: {e}")
        if run is not None:
            run.update(summary=out.summary(), engines=engines)
        return out
    out = LosslessOutcome([], engines, asdict(cfg), notes, rule=opts.rule_dict(), advisory=tuple(cfg.advisory))
    out.notes.append(f"tolerance: {'strict' if opts.rule == 'strict' else 'margin'} {opts.tol:g} nat ({opts.rule_reason})")
    if run is not None:
        out.run_id = run.run_id
        run.update(engines=engines)
    rec = recorded_acceptance(out.engines["candidate"])
    if rec is not None:
        out.notes.append(f"the fixture's BUILD.json records a mean accepted length of {rec:.2f} (offline replay on "
                         "other prompts and lengths: context for the measured value, not a gate)")

    counted = ("greedy", "concurrent") if cfg.concurrent else ("greedy",)  # the gates judged prompt by prompt
    tick = progress.advance if progress is not None else (lambda: None)
    if progress is not None:
        progress.plan(len(prompts) * len(counted))

    def on_prompt(gate: str) -> Callable[[PromptCheck], None]:
        def f(pc: PromptCheck) -> None:
            if run is not None:
                run.write("checks", {"gate": gate, "tolerance": opts.rule_dict(), **pc.to_dict()})
            tick()
        return f

    async def gate(name: str, coro) -> GateRun:
        if progress is not None:
            progress.phase(name, len(prompts) if name in counted else None)
        say(f"[lossless] {name} ...")
        g = await coro
        say(f"[lossless] {name}: {g.verdict} ({g.wall_s:.1f} s; {g.stats.describe()})")
        out.gates.append(g)
        _record(run, g)
        return g

    first: list[GateRun] = []
    if cfg.engine_gates:  # on a fresh engine, before anything else has captured a shape
        for spec in ENGINE_GATES:
            if spec.fresh:
                first.append(await gate(spec.name, GATES[spec.name](baseline, candidate, prompts, cfg.max_tokens,
                                                                    opts)))
    main = await gate("greedy", run_greedy(baseline, candidate, prompts, cfg.max_tokens, opts,
                                           concurrency=cfg.concurrency, on_prompt=on_prompt("greedy")))
    key, parts = accept_ref.fingerprint(engines["candidate"], [(p.messages if p.chat else p.ids) or [] for p in prompts],
                                        cfg.max_tokens, cfg.concurrency)
    stored = accept_ref.load(key, cfg.results) if cfg.accept_reference else None
    out.reference = {"key": key, "used": None, "source": None, "recorded": None}
    if cfg.expect_accept_len is not None:
        out.reference.update(used=cfg.expect_accept_len, source="--expect-accept-len")
    elif stored is not None:
        out.reference.update(used=stored.mean_accept_len, source=stored.describe())
    if out.reference["used"] is not None:
        main.checks.append(check_acceptance(main.stats, out.reference["used"],
                                            source="--expect-accept-len" if cfg.expect_accept_len is not None
                                            else "the recorded reference"))
        out.notes.append(f"acceptance reference: {out.reference['source']}")
    elif cfg.accept_reference:
        out.notes.append(f"acceptance reference: none recorded yet for this fingerprint ({key}); a PASS records one")
    out.gates = [main] + first  # the greedy gate leads the report and sets the speculation verdict
    if cfg.concurrent:
        await gate("concurrent", run_concurrent(baseline, candidate, prompts, cfg.max_tokens, opts,
                                                on_prompt=lambda _pc: tick()))
    if cfg.engine_gates:  # the rest, in the registry's order
        for spec in ENGINE_GATES:
            if not spec.fresh:
                await gate(spec.name, GATES[spec.name](baseline, candidate, prompts, cfg.max_tokens, opts))
    if cfg.rate_test:  # the spec-on divergences of greedy (+ concurrent) against the baseline's batch noise
        await gate("divergence-rate", run_rate_gate(baseline, prompts, cfg.max_tokens, opts, cfg.batch_options,
                                                    [g for g in out.gates if g.name in ("greedy", "concurrent")]))
    if cfg.batch_invariance:
        if progress is not None:
            progress.phase("batch invariance", None)
        say("[lossless] batch invariance ...")
        bprompts = await load_batch_prompts(baseline, candidate, cfg.dataset, cfg.batch_options.prompts_needed,
                                            cfg.max_prompt_chars)
        for g in await run_batch_invariance(baseline, candidate, bprompts, cfg.max_tokens, opts, cfg.batch_options):
            say(f"[lossless] {g.name}: {g.verdict} ({g.wall_s:.1f} s)")
            out.gates.append(g)
            _record(run, g)
    ran = [g.name for g in out.gates if out._advisory(g)]
    if ran:
        out.notes.append(f"on by default (--quick: the greedy gate alone): {', '.join(ran)}; a FAIL among them fails "
                         "the run, a CANNOT TEST is reported here without deciding the verdict")
    if out.not_tested:
        out.notes.append(f"not tested here (on by default, not asked for): {'; '.join(out.not_tested)}")
    faults = (engines["candidate"].get("config") or {}).get("faults") if isinstance(engines["candidate"], dict) else None
    if (run is not None and cfg.accept_reference and out.verdict == PASS and not faults and main.stats.known
            and main.stats.num_drafts and (stored is None or cfg.record_reference)):
        path = accept_ref.record(key, parts, main.stats, out.run_id, cfg.results)
        out.reference["recorded"] = str(path)
        out.notes.append(f"acceptance reference recorded: mean accepted length {main.stats.mean_accept_len:.3f} "
                         f"-> {path}" + (" (replacing the earlier one)" if stored is not None else ""))
    out.wall_s = time.perf_counter() - t0
    if run is not None:
        run.update(summary=out.summary())
    return out
