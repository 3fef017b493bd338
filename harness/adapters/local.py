"""`local` adapter: the reference engine in process, stepped by one background `EngineLoop` thread.

Contract: timings come from the engine's own clock (perf_counter): t_send is taken just before the
request is handed to the engine, each delta the engine emits is one chunk whose time is the emission
time of its tokens (`RequestOutput.token_times`), so chunk_tokens is exact (token_count_method
"engine"). Spec on and spec off are two adapters (two engines), never one engine toggled. A request
the engine refuses (ConfigError / AdmissionError) is a failed result, not an exception. Cancelling a
request's task aborts it in the engine, freeing its KV.
Capabilities (base.py): "faults" (the engine's fault catalogue; `with_faults` builds a fresh engine from
this one's config with `EngineConfig.faults` set), "decode_window" (the loop thread is held off while
the caller steps the engine itself; phase ranges are on when the engine was built with `trace_ranges`) and
"oracle_drafts" (`with_oracle_drafts`: a fresh engine from this one's config, faults kept, levers off, no drafter,
whose `OracleProposer` replays the given continuations, every draft accepted).
Run-time invariants: an engine built with `EngineConfig.check_invariants` (engine string `invariants=1`; the
gate commands set it, harness/engines.py `gate_specs`; `with_faults` keeps it) checks its page accounting and
drafter context after every step; a violation raises `InvariantError` inside the step, and every request in
flight then comes back failed with its message ("EngineFailure: engine step failed: ...InvariantError: step
N: request 'R' owns 6 pages where its committed length needs 5 (...)"), which a gate reports as a failed
prompt (FAIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from specbench.engine import ConfigError, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from specbench.engine.config import bias_pairs, engine_method, lever_kw, spec_method
from specbench.engine.scheduler import AdmissionError

from .base import (
    DECODE_WINDOW,
    FAULTS,
    LEVERS,
    ORACLE_DRAFTS,
    DecodeWindow,
    EngineAdapter,
    FaultInfo,
    GenRequest,
    GenResult,
    PosLogprobs,
    ScoreResult,
    UnsupportedCapability,
    failed,
)
from .loop import EngineFailure, EngineLoop


def sampling_params(req: GenRequest, **extra: Any) -> SamplingParams:
    """prompt_cache=False: the request takes no prefix hit and registers no block (SamplingParams.prompt_cache)."""
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, stop=tuple(req.stop),
                          stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
                          logprobs=req.logprobs, prompt_cache=req.prompt_cache is not False,
                          repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, logit_bias=bias_pairs(req.logit_bias),
                          min_tokens=req.min_tokens, **extra)


def engine_version() -> str:
    from specbench import __version__

    return __version__


class _LocalDecodeWindow(DecodeWindow):
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.device = engine.cfg.device
        self.phase_ranges = bool(engine.cfg.trace_ranges)

    def step(self) -> int:
        return sum(len(o.new_ids) for o in self.engine.step())

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished()


class LocalAdapter(EngineAdapter):
    kind = "local"
    capabilities = frozenset({FAULTS, DECODE_WINDOW, ORACLE_DRAFTS, LEVERS})
    # `score` computes logits for the continuation's rows only (SamplingParams.prompt_logprobs_from); True: for
    # every prompt row too, the simple path the fast one is tested against (tests/test_sampled_fit.py)
    score_all_rows = False

    def __init__(self, engine: LLMEngine, name: str | None = None, max_pending: int | None = None) -> None:
        super().__init__(name or ("local-spec" if engine.spec_on else "local"))
        self.engine = engine
        # every graph row count captured before the first request (CUDA; a no-op elsewhere), as the server's
        # warm-up does: a sweep cell must not time a lazy capture at its first new batch bucket
        engine.capture_graphs()
        self.loop = EngineLoop(engine, max_pending=max_pending)

    @classmethod
    def from_dirs(cls, model: str, draft: str | None = None, spec: str | None = None, k: int | None = None,
                  device: str = "cpu", dtype: str = "float32", name: str | None = None,
                  synthetic_tau: float | None = None, ngram_mix: float = 0.0, spec_gate: int | None = None,
                  spec_trim: int | None = None, spec_policy: str | None = None, spec_logprobs: bool | None = None,
                  **engine_kw: Any) -> LocalAdapter:
        """spec: resolved by `spec_method` (engine/config.py, the one spec-method rule). synthetic_tau: draw acceptance for
        speed curves on random weights (labelled in describe(); never for lossless). spec_gate / spec_trim /
        spec_policy: the load-aware levers (SpecConfig.gate / trim / policy; None = from the environment);
        spec_logprobs: logprobs requests speculate (SpecConfig.logprobs; None = from the environment)."""
        method = spec_method(spec, draft)
        levers = lever_kw(spec_gate, spec_trim, spec_policy)
        if spec_logprobs is not None:
            levers["logprobs"] = spec_logprobs
        cfg = EngineConfig(model=str(model), draft=str(draft) if draft and method == "dflash" else None,
                           device=device, dtype=dtype,
                           spec=SpecConfig(method=engine_method(method), num_speculative_tokens=k,
                                           synthetic_tau=synthetic_tau, ngram_mix=ngram_mix, **levers),
                           **engine_kw)
        return cls(LLMEngine(cfg), name=name)

    def _prompt(self, req: GenRequest) -> str | list[int]:
        if req.messages is not None:
            return self.engine.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        assert req.prompt is not None
        return req.prompt

    async def generate_one(self, req: GenRequest) -> GenResult:
        rid = self._rid(req)
        t_send = time.perf_counter()
        wall = time.time()
        try:
            params = sampling_params(req)
            rid, q = self.loop.submit(self._prompt(req), params, rid=rid)
        except (ConfigError, AdmissionError, EngineFailure, ValueError) as e:
            return failed(req, rid, f"{type(e).__name__}: {e}", t_send)
        res = GenResult(rid=rid, ok=True, t_send=t_send, wall_send=wall, meta=dict(req.meta))
        done = False
        try:
            while True:
                _, out = await q.get()
                if isinstance(out, Exception):
                    res.ok, res.error, res.t_end = False, f"{type(out).__name__}: {out}", time.perf_counter()
                    done = True
                    return res
                if out.new_ids:
                    t = out.token_times[-1] if out.token_times else time.perf_counter()
                    res.chunk_times.append(t)
                    res.chunk_tokens.append(len(out.new_ids))
                    if res.t_first is None:
                        res.t_first = t
                if out.finished:
                    done = True
                    self._finish(res, out)
                    return res
        finally:
            if not done:  # cancelled: free the engine's KV for this request
                self.loop.abort(rid)

    def _finish(self, res: GenResult, out: Any) -> None:
        res.text = out.text
        res.output_ids = list(out.output_ids)
        res.finish_reason = out.finish_reason
        res.prompt_tokens = len(out.prompt_ids)
        res.prompt_ids = list(out.prompt_ids)
        res.completion_tokens = len(out.output_ids)
        res.t_end = out.token_times[-1] if out.token_times else time.perf_counter()
        if res.t_first is None:
            res.t_first = res.t_end
        res.spec = dict(out.spec) if out.spec else None
        if out.logprobs is not None:
            res.logprobs = [PosLogprobs(token_id=t, logprob=lp, top=dict(top))
                            for t, (lp, top) in zip(out.output_ids, out.logprobs, strict=False)]
        if out.finish_reason == "abort":
            res.ok, res.error = False, "aborted by the engine"

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        if not prompt_ids or not continuation_ids:
            raise ValueError("score: prompt_ids and continuation_ids must both be non-empty")
        ids = list(prompt_ids) + list(continuation_ids)
        # logits only for the continuation's rows (score_all_rows: every prompt row, the simple path)
        frm = 0 if self.score_all_rows else len(prompt_ids)
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, prompt_logprobs_from=frm,
                                max_logprobs=max(top_k, SamplingParams.max_logprobs))
        rid, q = self.loop.submit(ids, params, rid=self.loop.new_rid("score"))
        try:
            while True:
                _, out = await q.get()
                if isinstance(out, Exception):
                    raise out
                if out.finished:
                    break
        finally:
            self.loop.abort(rid)
        plp = out.prompt_logprobs or []
        n = len(prompt_ids)
        return ScoreResult([PosLogprobs(token_id=ids[i], logprob=plp[i][0], top=dict(plp[i][1]))
                            for i in range(n, len(ids))])

    async def spec_counters(self) -> dict | None:
        snap = self.engine.metrics.snapshot()
        return {"num_drafts": snap["num_drafts"], "num_draft_tokens": snap["num_draft_tokens"],
                "num_accepted_tokens": snap["num_accepted_tokens"],
                "accepted_per_pos": list(snap["accepted_per_pos"]), "generation_tokens": snap["generation_tokens"],
                "num_full_accepts": snap["num_full_accepts"], "gated_rounds": snap["gated_rounds"],
                "span_hist": dict(snap["span_hist"]), "source": "engine", **self._policy_state()}

    def _policy_state(self) -> dict:
        """With the automatic span policy: what it currently believes (the acceptance estimate per position, the
        host overhead, the measured step time per (batch bucket, span)), a snapshot carried into each sweep
        cell's counters so a chosen span can be explained after the run."""
        pol = self.engine.policy
        if not pol.auto:
            return {}
        with self.engine._lock:
            d = pol.describe()
        return {"policy_state": {k: d[k] for k in ("acceptance", "overhead_ms", "measured_ms", "chained_ms",
                                                          "chain_frac")}}

    async def metrics_text(self) -> str | None:
        """The engine's Prometheus text, as `specbench serve` publishes it (gauges refreshed first)."""
        self.loop.refresh_gauges()
        return self.engine.metrics.prometheus(self.name)

    async def health(self) -> dict:
        """KV pool and queue snapshot (for leak checks): with nothing running, every page must be free."""
        e = self.engine
        with e._lock:
            return {"kv_free_pages": e.pool.num_free, "kv_total_pages": e.pool.num_pages,
                    "running": len(e.scheduler.running), "waiting": e.num_waiting(),
                    "pending": self.loop.num_pending}

    async def tokenize(self, text: str) -> list[int] | None:
        return self.engine.tokenizer.encode(text)

    async def reset_prefix_cache(self) -> bool | None:
        """The engine's `reset_prefix_cache` (False while a request holds a cached page); None when its prefix
        cache is off (nothing to flush: every request is cold)."""
        if self.engine.pool.prefix is None:
            return None
        return self.engine.reset_prefix_cache()

    def cold_requests(self) -> bool:
        return True

    def fault_catalogue(self) -> dict[str, FaultInfo]:
        """engine/faults.py's faults, each with its family and expected outcome (`armable_faults` is the base's)."""
        from specbench.engine.faults import FAULT_TYPES

        return {k: FaultInfo(f.description, f.family, f.expect) for k, f in FAULT_TYPES.items()}

    def with_faults(self, faults: Sequence[str], name: str | None = None) -> LocalAdapter:
        faults = tuple(faults)
        label = name or (f"{self.name}[{'+'.join(faults)}]" if faults else self.name)
        return LocalAdapter(LLMEngine(self.engine.cfg.with_(faults=faults)), name=label,
                            max_pending=self.loop.max_pending)

    def with_levers(self, gate: int | None = None, trim: int | None = None, policy: str | None = None,
                    name: str | None = None) -> LocalAdapter:
        cfg = self.engine.cfg
        if not self.engine.spec_on:
            raise UnsupportedCapability(self, LEVERS, "this engine does not speculate: it has no levers to set")
        levers = lever_kw(gate, trim, policy)
        label = name or f"{self.name}[{','.join(f'{k}={v}' for k, v in levers.items())}]"
        return LocalAdapter(LLMEngine(cfg.with_(spec=replace(cfg.spec, **levers))), name=label,
                            max_pending=self.loop.max_pending)

    def with_oracle_drafts(self, continuations: Mapping[tuple[int, ...], Sequence[int]],
                           name: str | None = None) -> LocalAdapter:
        from collections import defaultdict

        from specbench.engine.spec.proposer import OracleProposer

        cfg = self.engine.cfg
        k = self.engine.k if self.engine.spec_on and self.engine.k else 4
        cont: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)  # unknown prompts: filler drafts
        cont.update({tuple(p): list(c) for p, c in continuations.items()})
        oracle = OracleProposer(k, cont, lambda step, req: k, self.engine.mcfg.vocab_size)
        # No drafter (the oracle needs none); a small pool beside the engine already holding the device. The
        # load-aware levers off: the oracle's drafts are all verified, K a step, so the positions a gate plants
        # (near-ties' runner-up, eos-in-run's stops) are inside verify steps; the accept rule and faults are kept.
        ocfg = cfg.with_(draft=None, spec=replace(cfg.spec, method=None, **lever_kw(0, 0, "off")),
                         num_pages=cfg.num_pages or 512)
        return LocalAdapter(LLMEngine(ocfg, proposer=oracle), name=name or f"{self.name}[oracle]",
                            max_pending=self.loop.max_pending)

    @contextlib.contextmanager
    def decode_window(self, prompts: Sequence[str], max_tokens: int, warmup: int = 0) -> Iterator[DecodeWindow]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        with self.loop.exclusive() as eng:
            rids = [f"prof-{i}" for i in range(len(prompts))]
            try:
                for rid, p in zip(rids, prompts, strict=True):
                    eng.add_request(p, params, rid=rid)
                sched = eng.scheduler
                while eng.num_waiting() or any(r.in_prefill for r in sched.running):
                    eng.step()
                for _ in range(warmup):
                    eng.step()
                yield _LocalDecodeWindow(eng)
            finally:
                for rid in rids:  # aborting a finished request is a no-op
                    eng.abort(rid)

    def describe(self) -> dict:
        d = self.engine.describe()
        return {"name": self.name, "kind": self.kind, "version": engine_version(), "model": self.engine.cfg.model,
                "config": d}

    async def aclose(self) -> None:
        await asyncio.to_thread(self.loop.close)
