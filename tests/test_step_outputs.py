"""`LLMEngine.step(finished_only=True)` (what `generate` runs, issue 19): the finished outputs are those of the
plain step loop, field for field; running requests get no snapshot."""

from __future__ import annotations

from specbench.engine import LLMEngine, SamplingParams
from specbench.engine.config import EngineConfig, SpecConfig
from specbench.harness.fixtures import bundled_pair

TARGET, DRAFT = (str(p) for p in bundled_pair())
PROMPTS = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?", "a b c"]


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=TARGET, draft=DRAFT, spec=SpecConfig(method="dflash"), prefix_cache=False))


def _fields(o) -> tuple:
    return (o.rid, o.prompt_ids, o.output_ids, o.text, o.finish_reason, o.stop_reason, o.new_ids, o.logprobs,
            len(o.token_times), o.spec)


def test_generate_equals_the_full_step_loop() -> None:
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2 if n == 9 else None, stop=[" the"])
              for n in (9, 17, 30, 5)]
    a = _engine()
    rids = [a.add_request(p, sp, rid=f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
    full, running_snapshots = {}, 0
    while len(full) < len(rids):
        for out in a.step():
            if out.finished:
                full[out.rid] = out
            else:
                running_snapshots += 1
    assert running_snapshots > 0
    b = _engine()
    fast = b.generate(PROMPTS, params, rids=[f"r{i}" for i in range(len(PROMPTS))])
    assert [_fields(o) for o in fast] == [_fields(full[r]) for r in rids]


def test_finished_only_builds_no_running_snapshot() -> None:
    e = _engine()
    e.add_request("hello there", SamplingParams(max_tokens=6, temperature=0.0))
    seen = []
    while e.has_unfinished():
        seen += e.step(finished_only=True)
    assert len(seen) == 1 and seen[0].finished and len(seen[0].output_ids) == 6
