"""`LLMEngine`: add_request / step / generate over the scheduler, runner and proposer.

One step = plan (scheduler) -> propose (drafts for speculating requests) -> ONE target forward over all
spans -> accept/sample -> commit (KV + draft context) -> emit (stops, finish). A request that cannot
speculate (logprobs or prompt logprobs requested, sampling, not draft-ready, one token left) runs as a
span of 1 in the same step; it never turns speculation off for its neighbours.
Thread-safety: add_request / abort / step take one lock, so a server thread may add while a loop steps.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, SpecConfig
from .faults import check_faults
from .kv_cache import PagePool
from .loader import torch_dtype
from .memory import measure, plan_memory
from .metrics import EngineMetrics
from .models.dflash import DFlashDraftModel
from .models.qwen3 import Qwen3ForCausalLM
from .ranges import NO_RANGES, ProfilerRanges
from .request import Request
from .runner import ModelRunner
from .sampler import (
    draw_rows,
    make_generator,
    sampling_probs,
    sampling_probs_rows,
    select,
    topk_logprobs,
    uniforms,
)
from .scheduler import AdmissionError, Scheduler, Span, StepPlan
from .spec.accept import accept_greedy
from .spec.proposer import NgramProposer, Proposer
from .spec.sampling import accept_sampled, accept_sampled_batch
from .spec.synthetic import SyntheticAcceptance
from .tokenizer import Tokenizer

__all__ = ["LLMEngine", "RequestOutput", "AdmissionError"]
log = logging.getLogger("specbench.engine")


@dataclass
class RequestOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    spec: dict = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None


class LLMEngine:
    def __init__(self, cfg: EngineConfig, proposer: Proposer | None = None) -> None:
        self.cfg = cfg
        self.faults = check_faults(cfg.faults)
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(cfg.dtype)
        self.mcfg = ModelConfig.from_dir(cfg.model)
        if self.mcfg.is_dflash:
            raise ConfigError(f"model={cfg.model!r} is a DFlash drafter; pass it as draft= and a Qwen3 target as model=")
        self.tokenizer = Tokenizer(cfg.model)
        self.eos_ids = set(self.mcfg.eos_token_id) | _generation_eos(cfg.model)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.model = Qwen3ForCausalLM.load(cfg.model, self.mcfg, self.dtype, cfg.device)
        spec = cfg.spec
        self.draft_cfg: ModelConfig | None = None
        self.draft_model: DFlashDraftModel | None = None
        if cfg.draft:
            self.draft_cfg = ModelConfig.from_dir(cfg.draft)
            if not self.draft_cfg.is_dflash:
                raise ConfigError(f"draft={cfg.draft!r}: config.architectures={list(self.draft_cfg.architectures)!r}, "
                                  "expected DFlashDraftModel")
            self.draft_model = DFlashDraftModel.load(cfg.draft, self.draft_cfg, self.mcfg, self.dtype, cfg.device)
        if spec.method == "dflash" and self.draft_model is None and proposer is None:
            raise ConfigError("spec.method='dflash' needs a drafter: pass draft=<dir>")
        self.spec_on = spec.enabled or proposer is not None
        block = self.draft_cfg.block_size if self.draft_cfg else None
        self.k = self._resolve_k(spec, block, proposer)
        headroom = (proposer.headroom if proposer else (block if spec.method == "dflash" else self.k + 1)) \
            if self.spec_on else 0
        max_pos = self.mcfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or max_pos, max_pos) - headroom
        dflash_cfg = self.draft_cfg if (self.spec_on and spec.method == "dflash") else None
        # The drafter's weights and per-token state are reserved before the pool is sized (memory.py).
        self.memory = plan_memory(cfg, self.mcfg, dflash_cfg, self.dtype, self.max_model_len + headroom,
                                  k=self.k if self.spec_on else 0)
        self.pool = PagePool(self.memory.num_pages, cfg.page_size)
        self.scheduler = Scheduler(cfg, self.pool, self.max_model_len, headroom)
        self.runner = ModelRunner(cfg, self.mcfg, self.model, self.pool, self.device, self.dtype, dflash_cfg,
                                  self.faults, spec_span=self.k + 1 if self.spec_on else 0)
        self.proposer: Proposer | None = proposer
        if self.proposer is None and self.spec_on:
            if spec.method == "dflash":
                from .spec.dflash import DFlashProposer

                assert self.draft_model is not None
                self.proposer = DFlashProposer(self.k, self.draft_model, self.model, self.runner, self.pool,
                                               batched=spec.batched_draft, faults=self.faults)
            else:
                self.proposer = NgramProposer(self.k, spec.ngram_min, spec.ngram_max)
        self.metrics = EngineMetrics()
        self.requests: dict[str, Request] = {}
        self._gens: dict[str, torch.Generator] = {}
        if self.proposer is not None:
            self.proposer.generators = self._gens  # sampled drafts use the request's own generator
        self.ranges = ProfilerRanges() if cfg.trace_ranges else NO_RANGES
        self.synthetic = SyntheticAcceptance(spec.synthetic_tau, self.k, cfg.seed) \
            if (spec.synthetic_tau is not None and self.spec_on) else None
        self._gen = torch.Generator().manual_seed(cfg.seed)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        measure(self.memory, self.model, self.draft_model if dflash_cfg else None, self.runner, self.device)
        log.info("memory: %s", self.memory.summary())

    @staticmethod
    def _resolve_k(spec: SpecConfig, block: int | None, proposer: Proposer | None) -> int:
        if proposer is not None:
            return proposer.k
        if spec.method == "dflash":
            assert block is not None
            k = spec.num_speculative_tokens or block - 1
            if k > block - 1:
                raise ConfigError(f"spec.num_speculative_tokens={k} is invalid: expected <= block_size - 1 = {block - 1}")
            return k
        return spec.num_speculative_tokens or 4

    # ---- requests --------------------------------------------------------------------------------
    def describe(self) -> dict:
        return {"name": "specbench-local", "model": self.cfg.model, "draft": self.cfg.draft,
                "spec": self.proposer.name if self.proposer else None, "k": self.k if self.spec_on else 0,
                "dtype": self.cfg.dtype, "device": self.cfg.device, "num_pages": self.pool.num_pages,
                "page_size": self.pool.page_size, "max_model_len": self.max_model_len,
                "attention_backend": self.cfg.attention_backend, "eager": self.cfg.eager,
                "attention": self.runner.backend.name, "triton": self.runner.model.ops is not None,
                "decode_tensor_cores": self.cfg.decode_tensor_cores, "decode_attention": self.cfg.decode_attention,
                "gemv": self.cfg.gemv,
                "batched_draft": self.cfg.spec.batched_draft, "verify_graph": self.cfg.verify_graph,
                "draft_graph": self.cfg.draft_graph, "faults": sorted(self.faults),
                "synthetic_tau": self.cfg.spec.synthetic_tau if self.synthetic else None,
                "memory": self.memory.describe()}

    def memory_report(self) -> dict:
        """The memory plan with its measured figures refreshed (CUDA allocator peak included on the GPU)."""
        measure(self.memory, self.model, self.draft_model if self.runner.draft_kv else None, self.runner,
                self.device, getattr(self.proposer, "graphs", None))
        return self.memory.describe()

    def fast_path_stats(self) -> dict:
        """Which padded graph runners exist, their mode, captured row counts and padding so far."""
        out: dict = {}
        if self.runner.graphs is not None:
            out["decode"] = {"mode": self.runner.graphs.mode, "buckets": self.runner.graphs.buckets}
        if self.runner.verify_graphs is not None:
            out["verify"] = self.runner.verify_graphs.describe()
        dg = getattr(self.proposer, "graphs", None)
        if dg is not None:
            out["draft"] = dg.describe()
        return out

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list | tuple) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise ConfigError("prompt is invalid: expected a string or a list of token ids")
        bad = [t for t in ids if not 0 <= t < self.mcfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids {bad[:5]} are out of range: expected 0 <= id < {self.mcfg.vocab_size}")
        with self._lock:
            rid = rid if rid is not None else f"req-{next(self._ids)}"
            if rid in self.requests:
                raise ConfigError(f"request id {rid!r} is already in use")
            req = Request(rid, ids, params)
            try:
                self.scheduler.add(req)
            except AdmissionError:
                self.metrics.requests_rejected += 1
                raise
            self.requests[rid] = req
            self._gens[rid] = make_generator(params.seed, self.device, self._gen)
            return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            req = self.scheduler.abort(rid)
            if req is not None:
                req.finish("abort")
                self._release(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _release(self, req: Request) -> None:
        self.pool.free(req.rid)
        if self.proposer:
            self.proposer.release(req)
        self.requests.pop(req.rid, None)
        self._gens.pop(req.rid, None)

    # ---- the step --------------------------------------------------------------------------------
    def eligible(self, req: Request) -> bool:
        """Could this request ever speculate (so the proposer should track its context)?"""
        p = req.params
        return self.spec_on and p.logprobs is None and p.prompt_logprobs is None \
            and (p.greedy or self.cfg.spec.sampling)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            self.metrics.steps += 1
            ks = {}
            if self.proposer is not None:
                for r in self.scheduler.running:
                    if not r.in_prefill and self.eligible(r) and r.remaining >= 2 and self.proposer.ready(r):
                        ks[r.rid] = min(self.k, r.remaining - 1)
            with self.ranges.phase("schedule"):
                plan = self.scheduler.schedule(ks)
            if not plan.spans:
                return []
            with self.ranges.phase("draft"):
                self._propose(plan, ks)
            return self._execute(plan)

    def _propose(self, plan: StepPlan, ks: dict[str, int]) -> None:
        spans = [s for s in plan.spans if s.kind == "verify"]
        if not spans or self.proposer is None:
            return
        self.proposer.propose(spans, [ks[s.req.rid] for s in spans])
        for s in spans:
            if s.drafts:
                s.tokens = s.tokens + list(s.drafts)
            else:
                s.kind = "decode"

    def _execute(self, plan: StepPlan) -> list[RequestOutput]:
        rows: list[int] = []
        row_of: list[tuple[int, int]] = []  # per span: (first logits row, count)
        off = 0
        extra = 1 if "kv_offset" in self.faults else 0
        for s in plan.spans:
            n = len(s.tokens)
            self.pool.ensure(s.req.rid, s.start + n + (extra if s.kind == "verify" else 0))
            if s.kind == "prefill":
                want = list(range(n)) if s.req.params.prompt_logprobs is not None else \
                    ([n - 1] if s.completes_prefill else [])
            elif s.kind == "decode":
                want = [0]
            else:
                want = list(range(n))
            row_of.append((len(rows), len(want)))
            rows += [off + j for j in want]
            off += n
        tap = self.proposer.tap_layers if self.proposer else ()
        phase = "verify" if any(s.kind == "verify" for s in plan.spans) else "forward"
        with self.ranges.phase(phase):
            logits, taps = self.runner.forward(plan.spans, rows, tap)
        committed: list[int] = []
        new_tokens: list[list[int]] = []
        new_lps: list[list | None] = []
        with self.ranges.phase("accept"):
            # One batched argmax and one host transfer per step serve every greedy span (not one sync each).
            amax = logits.argmax(-1).tolist() if any(s.req.params.greedy for s in plan.spans) else None
            # Likewise every sampled verify span: one batched speculative-sampling resolve, one host read.
            sampled = self._accept_sampled(plan.spans, row_of, logits)
            # And every sampled single pick (decode spans, prefill completions): one batched draw.
            picks = self._sample_picks(plan.spans, row_of, logits)
            for i, (s, (r0, cnt)) in enumerate(zip(plan.spans, row_of, strict=True)):
                am = amax[r0:r0 + cnt] if amax is not None else None
                c, toks, lps = self._resolve(s, logits[r0:r0 + cnt], am, sampled.get(i), picks.get(i))
                committed.append(c)
                new_tokens.append(toks)
                new_lps.append(lps)
        with self.ranges.phase("commit"):
            return self._commit(plan, committed, new_tokens, new_lps, taps)

    def _commit(self, plan: StepPlan, committed: list[int], new_tokens: list[list[int]], new_lps: list,
                taps: torch.Tensor | None) -> list[RequestOutput]:
        if self.proposer is not None:
            self.proposer.observe(plan.spans, committed, taps, [self.eligible(s.req) for s in plan.spans])
        leak = "skip_rollback" in self.faults
        outs = []
        for s, c, toks, lps in zip(plan.spans, committed, new_tokens, new_lps, strict=True):
            req = s.req
            req.num_computed = s.start + c
            self.pool.commit(req.rid, req.num_computed, leak=leak and s.kind == "verify")
            if s.kind == "prefill":
                self.metrics.prompt_tokens += c
            if toks:
                self._append(req, toks, lps)
            if toks or req.finished:
                outs.append(self._output(req, toks))
            if req.finished:
                self.scheduler.finish(req)
                self._release(req)
                self.metrics.requests_finished += 1
        self.metrics.num_running = len(self.scheduler.running)
        self.metrics.num_waiting = len(self.scheduler.waiting)
        self.metrics.kv_usage = 1.0 - self.pool.num_free / self.pool.num_pages
        return outs

    def _accept_sampled(self, spans: list[Span], row_of: list[tuple[int, int]],
                        logits: torch.Tensor) -> dict[int, tuple[int, list[int]]]:
        """(accepted drafts, emitted tokens) of every sampled verify span, by span index, resolved together."""
        idx = [i for i, s in enumerate(spans) if s.kind == "verify" and not s.req.params.greedy]
        if not idx:
            return {}
        rows: list[int] = []
        params: list[SamplingParams] = []
        for i in idx:
            r0, cnt = row_of[i]
            rows += range(r0, r0 + cnt)
            params += [spans[i].req.params] * cnt
        sel = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        probs = sampling_probs_rows(sel, params)
        qs = [spans[i].draft_probs if isinstance(spans[i].draft_probs, torch.Tensor) else None for i in idx]
        res = accept_sampled_batch([list(spans[i].drafts) for i in idx], qs, probs,
                                   [self._gens[spans[i].req.rid] for i in idx], self.faults, kernel=self.cfg.triton)
        return dict(zip(idx, res, strict=True))

    def _sample_picks(self, spans: list[Span], row_of: list[tuple[int, int]],
                      logits: torch.Tensor) -> dict[int, int]:
        """The sampled token of every non-greedy decode span and prefill completion, by span index: each
        request's transform over its last row, an inverse-CDF draw with one uniform from its own generator,
        all on the device, one host read (instead of a multinomial and a sync per request)."""
        idx, rows, params = [], [], []
        for i, s in enumerate(spans):
            if s.req.params.greedy or not (s.kind == "decode" or (s.kind == "prefill" and s.completes_prefill)):
                continue
            r0, cnt = row_of[i]
            idx.append(i)
            rows.append(r0 + cnt - 1)
            params.append(s.req.params)
        if not idx:
            return {}
        probs = sampling_probs_rows(logits[torch.tensor(rows, device=logits.device)], params)
        u = uniforms([1] * len(idx), [self._gens[spans[i].req.rid] for i in idx], logits.device)
        return dict(zip(idx, draw_rows(probs, u).tolist(), strict=True))

    def _resolve(self, s: Span, lg: torch.Tensor, am: list[int] | None = None,
                 sampled: tuple[int, list[int]] | None = None,
                 pick: int | None = None) -> tuple[int, list[int], list | None]:
        """(rows committed to KV, new output tokens, their logprobs) for one span. `am`: the argmax of each
        of the span's logits rows, already on the host (greedy requests only); `sampled`: a sampled verify
        span's (accepted count, tokens), already resolved with the batch."""
        req, p = s.req, s.req.params
        gen = self._gens[req.rid]
        n = len(s.tokens)
        if s.kind == "prefill":
            if p.prompt_logprobs is not None:
                self._prompt_logprobs(s, lg)
            if not s.completes_prefill:
                return n, [], None
            last = lg[-1]
            tok = am[-1] if p.greedy and am else (pick if pick is not None else select(last, p, gen))
            return n, [tok], (topk_logprobs(last[None], [tok], p.logprobs) if p.logprobs is not None else None)
        if s.kind == "decode":
            tok = am[0] if p.greedy and am else (pick if pick is not None else select(lg[0], p, gen))
            return 1, [tok], (topk_logprobs(lg[:1], [tok], p.logprobs) if p.logprobs is not None else None)
        k = len(s.drafts)
        if not p.greedy:
            if sampled is None:
                q = s.draft_probs if isinstance(s.draft_probs, torch.Tensor) else None
                sampled = accept_sampled(list(s.drafts), q, sampling_probs(lg, p), gen, self.faults)
            m, toks = sampled
            self.metrics.record_verify(k, m)
            req.spec.record(k, m)
            return m + 1, toks, None
        argmax = am if am is not None else lg.argmax(-1).tolist()
        m, toks = accept_greedy(list(s.drafts), argmax)
        if self.synthetic is not None:  # speed curves only: the accept count is drawn, not matched
            m = self.synthetic.draw(k)
            toks = list(s.drafts[:m]) + [argmax[m]]
        if "accept_off_by_one" in self.faults and m < k:
            m += 1
            toks = list(s.drafts[:m]) + [argmax[m]]
        if "wrong_bonus" in self.faults:
            toks = toks[:-1] + [argmax[min(m + 1, k)]]
        self.metrics.record_verify(k, m)
        req.spec.record(k, m)
        return m + 1, toks, None

    def _prompt_logprobs(self, s: Span, lg: torch.Tensor) -> None:
        req, k = s.req, s.req.params.prompt_logprobs
        if s.start == 0:
            req.prompt_logprobs = [None]
        targets = [(j, s.start + j + 1) for j in range(len(s.tokens)) if s.start + j + 1 < req.prompt_len]
        if targets:
            rows = torch.tensor([j for j, _ in targets], device=lg.device)
            req.prompt_logprobs += topk_logprobs(lg[rows], [req.prompt_ids[p] for _, p in targets], k or 0)

    def _append(self, req: Request, toks: list[int], lps: list | None) -> None:
        now = time.perf_counter()
        p = req.params
        past_stop = "emit_past_stop" in self.faults
        for i, t in enumerate(toks):
            if req.finished and not past_stop:
                break
            req.output_ids.append(t)
            req.token_times.append(now)
            self.metrics.generation_tokens += 1
            if lps is not None:
                req.logprobs.append(lps[i])
            if req.finished:
                continue
            if not p.ignore_eos and t in self.eos_ids:
                req.finish("stop", None)
            elif t in p.stop_token_ids:
                req.finish("stop", t)
            elif p.stop and self._stop_string(req):
                pass
            elif len(req.output_ids) >= p.max_tokens:
                req.finish("length")
        if not req.finished and len(req.output_ids) >= p.max_tokens:
            req.finish("length")

    def _stop_string(self, req: Request) -> bool:
        text = self.tokenizer.decode(req.output_ids)
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            i = text.find(stop, max(0, req.output_text_len - len(stop)))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        req.output_text_len = len(text)
        if best is None:
            return False
        i, stop = best
        req.truncate_text_at = i + (len(stop) if req.params.include_stop_str_in_output else 0)
        req.finish("stop", stop)
        return True

    def text_of(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_ids)
        return text[: req.truncate_text_at] if req.truncate_text_at is not None else text

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        n_new = min(len(new), len(req.output_ids))
        return RequestOutput(
            rid=req.rid, prompt_ids=req.prompt_ids, output_ids=list(req.output_ids),
            text=self.text_of(req) if req.finished else self.tokenizer.decode_prefix_safe(req.output_ids),
            finished=req.finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            new_ids=req.output_ids[len(req.output_ids) - n_new:] if n_new else [],
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            arrival=req.arrival, token_times=list(req.token_times), spec=req.spec.as_dict())

    # ---- batch API -------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 rids: list[str] | None = None) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"params has {len(plist)} entries for {len(prompts)} prompts: expected one or one each")
        ids = [self.add_request(p, sp, rid=(rids[i] if rids else None))
               for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.rid] = out
        return [final[r] for r in ids]


def _generation_eos(model_dir: str) -> set[int]:
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return set()
    try:
        v = json.loads(f.read_text()).get("eos_token_id")
    except json.JSONDecodeError:
        return set()
    return set(v) if isinstance(v, list) else ({v} if isinstance(v, int) else set())

