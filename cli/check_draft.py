"""`specbench check-draft DIR`: would an engine silently draft this checkpoint wrong?

Contract: the checkpoint checks of harness/checkdraft.py (architecture resolved, every tensor consumed,
causality as declared) and, unless --no-acceptance, the acceptance sanity test of
harness/draft_variants.py (the engine's measured acceptance against the drafter's selector / causality
variants). `--selftest` proves every check catches its broken variant: a DFlash1 code path (arch
forced), forced-causal layers, and the engine faults selector_skipped and causal_draft must each FAIL,
the clean run PASS. Exit codes: 0 PASS, 1 FAIL, 2 bad usage, 3 CANNOT TEST.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def check_draft(
    draft: Path = typer.Argument(..., help="The drafter checkpoint directory (config.json + safetensors)."),
    target: Path | None = typer.Option(None, "--target", help="Its target model directory (default: the bundled "
                                                               "tiny target)."),
    engine: str | None = typer.Option(None, "--engine", help="Engine string of the engine under test for the "
                                                              "acceptance sanity test (default: the reference "
                                                              "engine with this pair)."),
    engine_faults: str = typer.Option("", "--engine-faults", help="Faults armed on the default engine under "
                                                                  "test (a+b), e.g. selector_skipped."),
    acceptance: bool = typer.Option(True, "--acceptance/--no-acceptance", help="Run the acceptance sanity test."),
    num_prompts: int = typer.Option(8, "--num-prompts", min=1, help="Bundled gsm8k prompts per run."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=8, help="Greedy tokens per prompt."),
    arch: str | None = typer.Option(None, "--arch", help="Load with this drafter class instead of the one the "
                                                          "config names (a broken engine, for testing)."),
    force_causal: bool = typer.Option(False, "--force-causal", help="Build the layers causal (a broken engine)."),
    selftest: bool = typer.Option(False, "--selftest", help="Prove each check fails on its broken variant."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document instead of the text report."),
) -> None:
    """Check a DFlash / DFlash2 drafter checkpoint: architecture, tensors consumed, causality, acceptance."""
    from specbench.engine.config import ConfigError
    from specbench.harness.checkdraft import CLASSES
    from specbench.harness.checkdraft import check_draft as run_checks
    from specbench.harness.draft_variants import run_variants
    from specbench.harness.errors import usage_errors
    from specbench.harness.fixtures import bundled_pair
    from specbench.harness.verdicts import FAIL, PASS, combine, exit_code

    bad = usage_errors("check-draft")
    if not (draft / "config.json").is_file():
        raise bad(f"DIR={str(draft)!r} is invalid: expected a drafter directory with config.json")
    if arch is not None and arch not in CLASSES:
        raise bad(f"--arch={arch!r} is invalid: expected one of {', '.join(CLASSES)}")
    tdir = str(target or bundled_pair()[0])
    faults = tuple(f for f in engine_faults.split("+") if f)
    say = (lambda _m: None) if as_json else typer.echo
    try:
        if selftest:
            rows = _selftest(str(draft), tdir, num_prompts, max_tokens, say)
            ok = all(r["as_expected"] for r in rows)
            if as_json:
                typer.echo(json.dumps({"selftest": rows, "verdict": PASS if ok else FAIL}))
            else:
                typer.echo(f"check-draft self-test: {PASS if ok else FAIL}")
            raise typer.Exit(0 if ok else 1)
        report = run_checks(draft, tdir, arch=arch, causal=True if force_causal else None)
        say(report.render())
        verdicts = [report.verdict]
        doc: dict = {"checks": report.to_dict()}
        if acceptance:
            eng = _probed(engine)
            try:
                v = run_variants(tdir, str(draft), eng, faults, num_prompts, max_tokens, log=say)
            finally:
                if eng is not None and not isinstance(eng, str):
                    eng.close()
            say(v.render())
            verdicts.append(v.verdict)
            doc["acceptance"] = v.to_dict()
    except ConfigError as e:
        raise bad(str(e)) from e
    verdict = combine(verdicts)
    doc["verdict"] = verdict
    typer.echo(json.dumps(doc) if as_json else f"verdict: {verdict}")
    raise typer.Exit(exit_code(verdict))


def _probed(engine: str | None):
    """An endpoint under test is probed before the variants are measured, so a key it refuses or a URL where
    nothing answers stops the command at once (in one line, exit 2: cli/app.py), not after a minute of variants.
    Other engines are left as strings (run_variants builds them)."""
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.engines import build_adapter, parse_engine
    from specbench.harness.redact import redact_text

    if engine is None or parse_engine(engine).kind != "openai":
        return engine
    ad = build_adapter(engine, name=redact_text(engine))
    if isinstance(ad, OpenAIAdapter):
        ad.probe()
    return ad


def _selftest(draft: str, target: str, num_prompts: int, max_tokens: int, say) -> list[dict]:
    """Each broken variant must FAIL the check named for it; the clean drafter must PASS."""
    from specbench.harness.checkdraft import check_draft as run_checks
    from specbench.harness.draft_variants import run_variants
    from specbench.harness.verdicts import FAIL, PASS

    rows: list[dict] = []

    def row(case: str, check: str, verdict: str, want: str, detail: str) -> None:
        rows.append({"case": case, "check": check, "verdict": verdict, "expected": want,
                     "as_expected": verdict == want, "detail": detail})
        say(f"  {case:<28} {check:<11} {verdict:<12} (expected {want}) {detail}")

    for case, kw, check in (("clean", {}, None), ("dflash1 code path", {"arch": "DFlashDraftModel"}, "tensors"),
                            ("causal draft layers", {"causal": True}, "causality")):
        r = run_checks(draft, target, **kw)
        if check is None:
            row(case, "all", r.verdict, PASS, "")
        else:
            c = next(x for x in r.checks if x.name == check)
            row(case, check, c.verdict, FAIL, c.detail)
    known = None  # the variants are measured once and shared by the three engine cases
    for case, faults in (("clean engine", ()), ("selector_skipped", ("selector_skipped",)),
                         ("causal_draft", ("causal_draft",))):
        v = run_variants(target, draft, None, faults, num_prompts, max_tokens, known=known)
        known = v.variants
        row(case, "acceptance", v.verdict, PASS if not faults else FAIL, v.detail)
    return rows


def local_draft_verdict(spec, log) -> str | None:
    """The checkpoint checks for the drafter of a local engine string (`lossless` runs them on its candidate);
    None when the engine is not local or drafts without a DFlash checkpoint."""
    from specbench.engine.config import spec_method
    from specbench.harness.checkdraft import check_draft as run_checks
    from specbench.harness.engines import bundled

    if spec.kind != "local":
        return None
    target, draft = spec.target, spec.options.get("draft")
    if not target:
        target, bdraft = bundled()
        draft = draft or bdraft
    if not draft or spec_method(spec.options.get("spec"), draft) != "dflash":
        return None
    report = run_checks(draft, target)
    log(report.render())
    return report.verdict
