"""Plain decode one step ahead (engine/ahead.py) against its off switch, token for token, on the tiny target
(fp32, CPU). On CPU the decode graph runner only runs when a test asks (`runner.use_graph_runner = True`:
the same padded body, eager); the ahead path then runs as on CUDA, with the copies synchronous.

The step() calls themselves must agree: each call commits one step in both modes (the ahead mode's GPU is
one step further, never its committed state), so with every request added up front the outputs of every
call are equal, finishes on a stop token, a stop string and max_tokens, and an abort in the middle
included; the invariants run after every step (tests/conftest.py) with the in-flight row counted.
"""

from __future__ import annotations

import pytest

from specbench.engine import LLM, SamplingParams
from specbench.engine.ahead import DecodeAhead


def _llm(tiny_target, ahead: bool, **kw) -> LLM:
    llm = LLM(tiny_target, num_pages=256, decode_ahead=ahead, **kw)
    llm.engine.runner.use_graph_runner = True  # the padded decode body (eager on CPU)
    return llm


def _key(o) -> tuple:
    return (o.rid, tuple(o.new_ids), tuple(o.output_ids), o.text, o.finished, o.finish_reason, o.stop_reason)


def _run(llm: LLM, reqs: list[tuple[str, SamplingParams]], abort_at: dict[int, str] | None = None) -> list[list]:
    """Every step() call's outputs until the engine is idle; abort_at[call] = rid aborted before that call."""
    eng = llm.engine
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(p, sp, rid=f"r{i}")
    calls: list[list] = []
    while eng.has_unfinished():
        if abort_at and len(calls) in abort_at:
            assert eng.abort(abort_at[len(calls)])
        calls.append(sorted(_key(o) for o in eng.step()))
        assert len(calls) < 500
    return calls


@pytest.fixture(scope="module")
def plain(tiny_target, gsm8k_prompts):
    """Greedy outputs of the off switch, to pick stop tokens and strings that do occur."""
    llm = _llm(tiny_target, ahead=False)
    outs = llm.generate(gsm8k_prompts[:3], SamplingParams(max_tokens=24, ignore_eos=True))
    return [o.output_ids for o in outs], [o.text for o in outs]


def _mix(prompts, plain) -> list[tuple[str, SamplingParams]]:
    ids, texts = plain
    stop_text = texts[1][len(texts[1]) // 2:][:3]  # a string from the middle of an output: a stop mid-chain
    return [
        (prompts[0], SamplingParams(max_tokens=24, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=24, stop=(stop_text,), ignore_eos=True)),
        (prompts[2], SamplingParams(max_tokens=24, stop_token_ids=(ids[2][9],), ignore_eos=True)),
        (prompts[3], SamplingParams(max_tokens=5, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=17, temperature=0.8, top_k=20, seed=7, ignore_eos=True)),
        (prompts[5], SamplingParams(max_tokens=13, temperature=1.0, min_p=0.05, ignore_eos=True)),  # unseeded
        (prompts[0], SamplingParams(max_tokens=1, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=20)),  # EOS allowed
    ]


def test_every_step_call_equals_the_off_switch(tiny_target, gsm8k_prompts, plain) -> None:
    reqs = _mix(gsm8k_prompts, plain)
    on, off = _llm(tiny_target, True), _llm(tiny_target, False)
    got, want = _run(on, reqs), _run(off, reqs)
    assert got == want
    assert on.engine.metrics.decode_ahead_steps >= 10  # the chain ran (not a fallback to the simple path)
    assert off.engine.metrics.decode_ahead_steps == 0
    assert any(k[5] == "stop" for call in got for k in call)  # a stop ended a request inside a chain
    assert on.engine.pool.num_free == off.engine.pool.num_free  # every page back, the in-flight ones included


def test_an_abort_in_the_middle_of_a_chain(tiny_target, gsm8k_prompts, plain) -> None:
    reqs = _mix(gsm8k_prompts, plain)
    on, off = _llm(tiny_target, True), _llm(tiny_target, False)
    abort_at = {6: "r0", 9: "r4"}
    got, want = _run(on, reqs, abort_at), _run(off, reqs, abort_at)
    assert got == want
    assert on.engine.metrics.decode_ahead_steps > 0
    assert on.engine.pool.num_free == off.engine.pool.num_free


def test_arrivals_and_a_full_batch_end_the_chain(tiny_target, gsm8k_prompts) -> None:
    """Requests beyond max_num_seqs wait; each admission ends a chain (the step in flight is committed first,
    the newcomer's prefill then runs as a normal step): the per-request outputs equal the off switch's."""
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    res = {}
    for ahead in (True, False):
        llm = _llm(tiny_target, ahead, max_num_seqs=3)
        outs = llm.generate(gsm8k_prompts[:7], [sp.with_(max_tokens=6 + 3 * i) for i in range(7)])
        res[ahead] = [o.output_ids for o in outs]
        if ahead:
            assert llm.engine.metrics.decode_ahead_steps > 0
    assert res[True] == res[False]


def test_a_later_generate_after_a_chain_left_a_dead_step(tiny_target, gsm8k_prompts, plain) -> None:
    """A chain's last step may outlive every request (each finished by a stop it could not foresee); the next
    call commits nothing from it and schedules the new requests."""
    on = _llm(tiny_target, True)
    ids = plain[0]
    sp = SamplingParams(max_tokens=24, stop_token_ids=(ids[0][5],), ignore_eos=True)
    first = on.generate([gsm8k_prompts[0]], sp)[0]
    assert first.finish_reason == "stop" and on.engine.ahead.inflight is not None  # the dead row's step
    second = on.generate([gsm8k_prompts[1]], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    alone = _llm(tiny_target, False).generate([gsm8k_prompts[1]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert second.output_ids == alone[0].output_ids
    assert not on.engine.has_unfinished()


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True),
                                    SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=3,
                                                   ignore_eos=True)])
def test_requests_it_cannot_serve_take_the_simple_path(tiny_target, gsm8k_prompts, params) -> None:
    """Logprobs are read per step on the host, and top-p's transform reads the host: no chain."""
    on, off = _llm(tiny_target, True), _llm(tiny_target, False)
    a = on.generate(gsm8k_prompts[:2], params)
    b = off.generate(gsm8k_prompts[:2], params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert on.engine.metrics.decode_ahead_steps == 0


def test_off_without_the_graph_runner_or_with_speculation(tiny_target, tiny_draft) -> None:
    llm = LLM(tiny_target, num_pages=256)  # CPU: no graph runner unless asked
    assert not DecodeAhead(llm.engine).usable()
    spec = LLM(tiny_target, draft=tiny_draft, num_pages=256, gated_ahead=False)
    spec.engine.runner.use_graph_runner = True
    assert not spec.engine.ahead.usable()  # with speculation only gated rounds chain (tests/test_gated_ahead.py)
    spec.engine.ahead.gated = True
    assert spec.engine.ahead.usable() and not spec.engine.ahead.eligible(
        spec.engine.scheduler.schedule({}, {}))  # nothing to run: no chain
    assert _llm(tiny_target, True).engine.ahead.usable()
    assert not _llm(tiny_target, False).engine.ahead.usable()


def test_the_env_switch(tiny_target, monkeypatch) -> None:
    monkeypatch.setenv("SPECBENCH_DECODE_AHEAD", "0")
    llm = LLM(tiny_target, num_pages=256)
    assert llm.engine.cfg.decode_ahead is False


def test_the_engine_string_switch(tiny_target) -> None:
    from specbench.harness.engines import build_adapter

    assert build_adapter(f"local:{tiny_target},decode_ahead=0").engine.cfg.decode_ahead is False
    assert build_adapter(f"local:{tiny_target},decode_ahead=1").engine.cfg.decode_ahead is True
    with pytest.raises(ValueError, match="decode_ahead"):
        build_adapter(f"local:{tiny_target},decode_ahead=maybe")


def test_the_steps_are_counted_on_both_metrics_endpoints(tiny_target, gsm8k_prompts) -> None:
    """The engine's own text and the served /metrics collector show how many steps ran ahead."""
    from types import SimpleNamespace

    from specbench.harness.server.metrics import EngineCollector

    llm = _llm(tiny_target, True)
    llm.generate(gsm8k_prompts[:2], SamplingParams(max_tokens=12, ignore_eos=True))
    n = llm.engine.metrics.decode_ahead_steps
    assert n > 5
    assert f'specbench:decode_ahead_steps_total{{model_name="x"}} {n}' in llm.engine.metrics.prometheus("x")
    fams = {f.name: f for f in EngineCollector(SimpleNamespace(engine=llm.engine, num_pending=0), ("x", "e")).collect()}
    assert [s.value for s in fams["specbench:decode_ahead_steps"].samples if s.name.endswith("_total")] == [n]
