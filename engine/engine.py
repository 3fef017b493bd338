"""`LLMEngine`: add_request / step / abort / generate over the scheduler, runner and proposer.

One step reads as its five phases, each a call into the module named for it:
  schedule  spec/policy.py `SpanPolicy.choose` (drafts per request) + scheduler.py: the step plan, a flat
            batch of token spans
  propose   spec/propose.py: drafts for the verify spans (the proposer's draft pass)
  forward   forward.py: ONE target forward over all spans (runner.py; the faults' forward hook)
  accept    accept_step.py: every span's new tokens (greedy match, rejection sampling, picks)
  commit    commit.py: KV rollback, drafter context, stop handling and outputs (output.py), counters
then, with `EngineConfig.check_invariants`, the run-time invariants (invariants.py) after the commit.
A plan of plain decode (no speculation, no logprobs, no top-p) may instead run one step ahead
(ahead.py, `EngineConfig.decode_ahead`): launched with its tokens drawn on the device, the next step chained
from them, then committed; each step() call still returns one step's outputs.
A request that cannot speculate (prompt logprobs requested, logprobs with SpecConfig.logprobs off, sampling with
spec sampling off, not draft-ready, one token left) runs as a span of 1 in the same step; it never turns speculation off for
its neighbours. Which speculation a run uses (method, K, headroom) is decided once (spec/plan.py); the
self-test's faults are one object (faults.py) whose hooks the phases call.
Thread-safety: step / abort take one lock, so a server thread may add or abort while a loop steps. With that
lock free add_request takes it and puts the request straight into the scheduler. A request added while a step
runs (or another thread holds that lock) does not wait for it: add_request checks it (every refusal is raised
to the caller) and leaves it in an inbox under a lock of its own, and the next step (or add_request, or abort)
takes the inbox into the scheduler first, in the order the requests entered the inbox. Off switch: EngineConfig.admit_inbox=False or
SPECBENCH_ADMIT_INBOX=0 (add_request takes the step lock and goes straight into the scheduler, waiting for a step
in flight).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import torch

from specbench import env

from .accept_step import AcceptStep
from .ahead import DecodeAhead
from .commit import CommitStep
from .config import ConfigError, EngineConfig, ModelConfig, SamplingParams, require_device
from .faults import make_faults
from .forward import run_forward
from .invariants import InvariantChecker, InvariantError
from .kv_cache import PagePool
from .loader import torch_dtype
from .memory import measure, plan_memory
from .metrics import EngineMetrics
from .models.dflash import DFlashDraftModel
from .models.dflash2 import drafter_class, load_draft_config
from .models.qwen3 import Qwen3ForCausalLM
from .output import OutputWriter, RequestOutput, eos_ids
from .prefix_cache import PrefixIndex
from .prefix_share import PrefixSharing
from .ranges import NO_RANGES, ProfilerRanges
from .request import Request
from .runner import ModelRunner
from .sampler import make_generator
from .scheduler import AdmissionError, Scheduler
from .spec.costs import COSTS_ENV, load_costs, measure_costs
from .spec.plan import make_proposer, resolve_spec
from .spec.policy import SpanPolicy
from .spec.propose import propose
from .spec.proposer import Proposer
from .spec.synthetic import SyntheticAcceptance
from .stops import StopScan, stop_set
from .teardown import KEEP_AT_CLOSE, EngineClosed, dismantle
from .tokenizer import Tokenizer

__all__ = ["LLMEngine", "RequestOutput", "AdmissionError", "InvariantError"]
log = logging.getLogger("specbench.engine")


class LLMEngine:
    def __init__(self, cfg: EngineConfig, proposer: Proposer | None = None) -> None:
        self.cfg = cfg
        self.faults = make_faults(cfg.faults)
        require_device(cfg.device)  # no CUDA where one is named: DeviceUnavailable (CANNOT TEST), not a torch assert
        self.device = torch.device(cfg.device)
        self.dtype = torch_dtype(cfg.dtype)
        self.mcfg = ModelConfig.from_dir(cfg.model)
        if self.mcfg.is_dflash:
            raise ConfigError(f"model={cfg.model!r} is a DFlash drafter; pass it as draft= and a Qwen3 target as model=")
        self.tokenizer = Tokenizer(cfg.model)
        self.eos_ids = eos_ids(cfg.model, self.tokenizer)
        self.model = Qwen3ForCausalLM.load(cfg.model, self.mcfg, self.dtype, cfg.device)
        self.model.emulate_tp(cfg.tp_emulate)  # TP-N reduction order in o_proj / down_proj (1: off)
        self.draft_cfg, self.draft_model = self._load_drafter()
        self.spec = resolve_spec(cfg.spec, self.draft_cfg, proposer)
        self.spec_on, self.k = self.spec.enabled, self.spec.k  # the names adapters and benchmarks read
        max_pos = self.mcfg.max_position_embeddings
        context = min(cfg.max_model_len or max_pos, max_pos)  # positions a request may touch, headroom included
        self.max_model_len = context - self.spec.headroom
        dflash_cfg = self.draft_cfg if self.spec.drafter else None
        # The drafter's weights and per-token state are reserved before the pool is sized (memory.py).
        self.memory = plan_memory(cfg, self.mcfg, dflash_cfg, self.dtype, context, k=self.spec.draft_tokens)
        self.pool = PagePool(self.memory.num_pages, cfg.page_size, self._prefix_index())
        self.scheduler = Scheduler(cfg, self.pool, self.max_model_len, self.spec.headroom)
        self.runner = ModelRunner(cfg, self.mcfg, self.model, self.pool, self.device, self.dtype, dflash_cfg,
                                  spec_span=self.spec.verify_span, span_variants=self.spec.span_variants,
                                  seq_pages=-(-context // cfg.page_size) + 1)
        self.proposer = proposer if proposer is not None else \
            make_proposer(self.spec, cfg.spec, self.draft_model, self.model, self.runner, self.pool)
        if cfg.graph_context and not self.faults.names and proposer is None:  # the faults break the rule it keeps
            self.runner.context_writer = getattr(self.proposer, "write_context", None)
        self.metrics = EngineMetrics()
        # greedy drafts kept on the device until the accept (spec/pending.py); off with a fault armed (the faults
        # read and rewrite drafts on the host)
        self.defer_drafts = cfg.defer_drafts and not self.faults.names
        # prefix hits at admission, sealing at commit (prefix_share.py); blocks carry the drafter's capture
        self.prefix = PrefixSharing(self.pool, self.metrics, drafter=self.spec.drafter and proposer is None)
        self.prefix.proposer = self.proposer
        self.scheduler.prefix = self.prefix
        self.policy = SpanPolicy(self.spec, None, self.metrics)  # the gate, the trim, the automatic span policy
        self.requests: dict[str, Request] = {}
        self._gens: dict[str, torch.Generator] = {}
        if self.proposer is not None:
            self.proposer.generators = self._gens  # sampled drafts use the request's own generator
        self.ranges = ProfilerRanges() if cfg.trace_ranges else NO_RANGES
        self.synthetic = SyntheticAcceptance(cfg.spec.synthetic_tau, self.k, cfg.seed) \
            if (cfg.spec.synthetic_tau is not None and self.spec_on) else None
        self.output = OutputWriter(self.tokenizer, self.eos_ids, self.metrics, incremental=cfg.incremental_detok)
        self.accept_step = AcceptStep(self._gens, self.faults, self.synthetic, kernel=cfg.triton, eos=self.eos_ids)
        self.commit_step = CommitStep(self.pool, self.scheduler, self.proposer, self.spec, self.metrics, self.output,
                                      self.faults, self._release, prefix=self.prefix)
        self.invariants = InvariantChecker(self.pool, self.scheduler, self.proposer, self.spec) \
            if cfg.check_invariants else None
        self.ahead = DecodeAhead(self)  # plain decode one step ahead (engine/ahead.py; EngineConfig.decode_ahead)
        self.policy.chain_ok = self.ahead.usable  # whether its one-token rounds can chain (their cost, the policy's)
        self.step_count = 0  # step() calls so far (the step an InvariantError names)
        self._gen = torch.Generator().manual_seed(cfg.seed)
        self._ids = itertools.count()
        self._lock = threading.RLock()
        # requests added but not yet taken into the scheduler (see the module docstring), in arrival order
        self._inbox: dict[str, tuple[Request, torch.Generator]] = {}
        self._inbox_lock = threading.Lock()
        self.admit_inbox = cfg.admit_inbox
        measure(self.memory, self.model, self.draft_model if dflash_cfg else None, self.runner, self.device)
        log.info("memory: %s", self.memory.summary())
        if self.spec.policy == "auto" and self.proposer is not None:  # the cost model, with the graphs it times
            saved = env.get(COSTS_ENV)
            self.policy.costs = load_costs(saved) if saved else \
                measure_costs(self.runner, self.proposer, self.spec.span_variants, cfg.max_num_seqs)

    def _prefix_index(self) -> PrefixIndex | None:
        """The prefix cache's index (None with `prefix_cache` off): at most `prefix_cache_pages` pages, and the
        capture budget in blocks, `spec_capture_cache_mb` over the drafter's context bytes per block."""
        cfg, mem = self.cfg, self.memory
        if not cfg.prefix_cache:
            return None
        if cfg.prefix_cache_pages is not None and cfg.prefix_cache_pages > mem.num_pages:
            raise ConfigError(f"prefix_cache_pages={cfg.prefix_cache_pages} is invalid: expected an integer in "
                              f"[1, {mem.num_pages}] (the pool's pages)")
        blocks = None
        if cfg.spec_capture_cache_mb is not None:
            per_block = cfg.page_size * mem.draft_bytes_per_token
            blocks = int(cfg.spec_capture_cache_mb * 2**20 // per_block) if per_block else None
        return PrefixIndex(cfg.page_size, cfg.prefix_cache_pages, blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's POST /reset_prefix_cache); False, changing nothing, while a running
        request holds a cached page."""
        with self._lock:
            return self.pool.reset_prefix()

    def _load_drafter(self) -> tuple[ModelConfig | None, DFlashDraftModel | None]:
        cfg = self.cfg
        if not cfg.draft:
            return None, None
        draft_cfg = load_draft_config(cfg.draft)  # DFlash2's flat fields accepted
        if not draft_cfg.is_dflash:
            raise ConfigError(f"draft={cfg.draft!r}: config.architectures={list(draft_cfg.architectures)!r}, "
                              "expected DFlashDraftModel or DFlash2DraftModel")
        # The class `architectures` names: a DFlash2 checkpoint never drafts through DFlash1's code.
        return draft_cfg, drafter_class(draft_cfg).load(cfg.draft, draft_cfg, self.mcfg, self.dtype, cfg.device)

    # ---- requests --------------------------------------------------------------------------------
    def describe(self) -> dict:
        return {"name": "specbench-local", "model": self.cfg.model, "draft": self.cfg.draft,
                "vocab_size": self.mcfg.vocab_size, "spec": self.proposer.name if self.proposer else None, "k": self.spec.draft_tokens,
                "ngram": ([self.cfg.spec.ngram_min, self.cfg.spec.ngram_max]
                          if self.proposer is not None and self.proposer.name == "ngram" else None),
                "dtype": self.cfg.dtype, "device": self.cfg.device, "num_pages": self.pool.num_pages,
                "page_size": self.pool.page_size, "max_model_len": self.max_model_len,
                "attention_backend": self.cfg.attention_backend, "eager": self.cfg.eager,
                "graph_runner": self.runner.use_graph_runner,
                "attention": self.runner.backend.name, "triton": self.runner.model.ops is not None,
                "decode_tensor_cores": self.cfg.decode_tensor_cores, "decode_attention": self.cfg.decode_attention,
                "gemv": self.cfg.gemv, "skinny": self.cfg.skinny, "selector_kernel": getattr(self.proposer, "walk_kernel", None),
                "decode_ahead": self.ahead.usable() and self.proposer is None,
                "gated_ahead": self.ahead.usable() and self.proposer is not None,
                "whole_graphs": self.cfg.whole_graphs and self.runner.backend.rows_ok,
                "defer_drafts": self.defer_drafts and bool(self.proposer is not None and self.proposer.defers),
                "batched_draft": self.cfg.spec.batched_draft, "verify_graph": self.cfg.verify_graph,
                "draft_graph": self.cfg.draft_graph, "graph_context": self.runner.context_writer is not None,
                "faults": sorted(self.faults.names),
                "check_invariants": self.invariants is not None,
                "synthetic_tau": self.cfg.spec.synthetic_tau if self.synthetic else None,
                "prefix_cache": self.pool.prefix is not None,
                "prefix_cache_pages": self.pool.prefix.capacity if self.pool.prefix is not None else None,
                "capture_blocks": self.pool.prefix.capture_blocks if self.pool.prefix is not None else None,
                "gate": self.spec.gate, "trim": self.spec.trim, "policy": self.spec.policy,
                "spec_logprobs": self.spec.logprobs, "tp_emulate": self.cfg.tp_emulate,
                "levers": self.policy.describe() if self.spec.policy == "auto" else None,
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
        dg = getattr(self.proposer, "graphs2", None) or getattr(self.proposer, "graphs", None)  # DFlash2's, else DFlash1's
        if dg is not None:
            out["draft"] = dg.describe()
        return out

    def capture_graphs(self) -> dict:
        """Capture now every padded-runner row count a step can take (CUDA graphs on; a no-op elsewhere): the
        target's decode buckets, its verify / prefill-mixed rows and the drafter's draft rows (bucket x block), so
        that no step under load waits for a lazy capture (before, the first draft at each new batch bucket, and a
        speculating engine's first one-token step, captured graphs in the middle of serving or of a measured
        cell); returns {"verify_rows", "draft_rows", "decode_buckets": what was captured now}."""
        self._check_open()
        r = self.runner
        out: dict = {"verify_rows": [], "draft_rows": [], "decode_buckets": []}
        if r.device.type != "cuda" or self.cfg.eager:
            return out
        tap = tuple(self.proposer.tap_layers) if self.proposer is not None else ()
        if r.use_graph_runner:  # the decode graphs capture every bucket when built (a one-token step's first use)
            fresh = r.graphs is None or r.graphs.tap != tap or r.graphs.context is not r.context_writer_for(tap)
            dg = r.decode_graphs(tap)
            out["decode_buckets"] = list(dg.buckets) if fresh else []
        if r.use_graph_runner and self.cfg.verify_graph:
            out["verify_rows"] = r.verify_graphs_for(tap).capture_all()
        drafts = getattr(self.proposer, "capture_graphs", None)
        if callable(drafts):
            out["draft_rows"] = drafts()
        return out

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    rid: str | None = None) -> str:
        self._check_open()
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
        for name, tids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in tids if t >= self.mcfg.vocab_size]
            if bad:  # a stop id the model cannot emit would never stop anything: refused, not ignored
                raise ConfigError(f"{name}={bad[:5]} is out of range: expected token ids 0 <= id < "
                                  f"{self.mcfg.vocab_size}")
        # the stop strings' automaton (engine/stops.py) built here, on the caller's thread, not inside a step
        scan = StopScan(stop_set(params.stop)) if params.stop else None
        # the step lock free (no step in flight, no abort) or the inbox off: straight into the scheduler, after
        # any earlier arrivals
        direct = self._lock.acquire(blocking=not self.admit_inbox)
        if direct:
            try:
                with self._inbox_lock:
                    self._drain_inbox()
                    req, gen = self._admission(ids, params, rid, scan)
                    self._enter(req, gen)
                return req.rid
            finally:
                self._lock.release()
        with self._inbox_lock:  # a step is in flight: leave it for the next one
            req, gen = self._admission(ids, params, rid, scan)
            self._inbox[req.rid] = (req, gen)
            return req.rid

    def _admission(self, ids: list[int], params: SamplingParams, rid: str | None, scan: StopScan | None = None
                   ) -> tuple[Request, torch.Generator]:
        """The request and its generator, or the refusal (a rid in use, a request that can never be served);
        with the inbox lock or the step lock held."""
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        if rid in self.requests or rid in self._inbox:
            raise ConfigError(f"request id {rid!r} is already in use")
        req = Request(rid, ids, params, stop_scan=scan)
        try:
            self.scheduler.check(req)
        except AdmissionError:
            self.metrics.requests_rejected += 1
            raise
        # before the scheduler sees it: a generator that cannot be made (a seed torch refuses) must not
        # leave a scheduled request without one, which failed every later step
        return req, make_generator(params.seed, self.device, self._gen)

    def _enter(self, req: Request, gen: torch.Generator) -> None:
        self.scheduler.add(req)  # checked by _admission already: the same static limits
        self.requests[req.rid] = req
        self._gens[req.rid] = gen

    def _drain_inbox(self) -> None:
        """With both locks held: the inbox into the scheduler, in arrival order (each entry leaves the inbox as
        it enters the scheduler, so a refusal midway cannot enter one twice)."""
        while self._inbox:
            rid = next(iter(self._inbox))
            req, gen = self._inbox.pop(rid)
            self._enter(req, gen)

    def _take_inbox(self) -> None:
        """With the step lock held: the inbox into the scheduler, in arrival order."""
        if self._inbox:
            with self._inbox_lock:
                self._drain_inbox()

    def abort(self, rid: str) -> bool:
        """Stop `rid` and free what it holds; whether the engine had it (False: unknown or finished)."""
        with self._lock:
            self._take_inbox()
            req = self.scheduler.abort(rid)
            if req is not None:
                req.finish("abort")
                if self.faults.abort_frees:
                    self._release(req)
                else:  # the abort_keeps_pages fault: gone from the batch, its pages never freed
                    self.requests.pop(req.rid, None)
            return req is not None

    def has_unfinished(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def num_waiting(self) -> int:
        """Requests added and not yet running: the scheduler's waiting queue and the inbox."""
        return len(self.scheduler.waiting) + len(self._inbox)

    def _release(self, req: Request) -> None:
        self.pool.free(req.rid)
        if self.proposer:
            self.proposer.release(req)
        self.requests.pop(req.rid, None)
        self._gens.pop(req.rid, None)

    # ---- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Give back the weights, the KV pool, the graphs and every buffer now, without waiting for the cycle
        collector (engine/teardown.py); idempotent. Afterwards step/add_request raise EngineClosed."""
        if self.__dict__.get("_closed"):
            return
        with self._lock:
            cuda = self.device.type == "cuda"
            keep: dict[str, object] = {k: self.__dict__[k] for k in ("cfg", "tokenizer", "_lock", "device")
                                       if k in self.__dict__}
            parts = [v for k, v in vars(self).items() if k not in keep]
            vars(self).clear()
            self.__dict__.update(keep, _closed=True)
            dismantle(parts, keep=(*KEEP_AT_CLOSE, LLMEngine))  # parts that point back (DecodeAhead.engine)
            del parts
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.__dict__.get("_closed"):
            raise EngineClosed("this engine was closed (LLM.close / del llm): build a new one")

    # ---- the step --------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One step: schedule -> propose -> forward -> accept -> commit. Returns the outputs of the requests
        that got new tokens or finished; with `finished_only`, of the finished ones alone (`generate`: no
        per-step snapshot of a running request is built). With `check_invariants` the run-time invariants are
        checked after the commit (engine/invariants.py; InvariantError on a violation)."""
        self._check_open()
        with self._lock:
            self._take_inbox()
            self.metrics.steps += 1
            self.step_count += 1
            if self.ahead.dead():  # in flight, every row's request gone since its launch: nothing to chain
                self.ahead.drain()
            if self.ahead.inflight is not None:  # a decode step on the device: chain the next, commit it
                chained = self.ahead.step(finished_only)
                self._check_invariants()
                return chained
            with self.ranges.phase("schedule"):
                ks, states = self.ahead.take_choice() or \
                    self.policy.choose(self.scheduler.running, self.proposer, self.step_count)
                plan = self.scheduler.schedule(ks, states)
            if self.ahead.eligible(plan):  # plain decode: launched, the next one chained, then committed
                started = self.ahead.start(plan, finished_only)
                self._check_invariants()
                return started
            outs: list[RequestOutput] = []
            if plan.spans:
                with self.ranges.phase("draft"):
                    propose(plan, self.proposer, ks, self.faults, defer=self.defer_drafts)
                with self.ranges.phase("verify" if plan.has_verify else "forward"):
                    fwd = run_forward(plan, self.runner, self.proposer, self.faults)
                with self.ranges.phase("accept"):
                    if plan.pending is not None:  # deferred drafts: on the host before they are judged
                        plan.pending.resolve()
                    results = self.accept_step.accept(plan, fwd)
                    self.policy.record(plan, results)
                with self.ranges.phase("commit"):
                    outs = self.commit_step.commit(plan, results, fwd.taps, finished_only)
                self.policy.step_done(busy=self.has_unfinished())
            self._check_invariants()
            return outs

    def _check_invariants(self) -> None:
        if self.invariants is not None:
            self.invariants.check(self.step_count, self.ahead.reserved())

    # ---- batch API -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 rids: list[str] | None = None) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"params has {len(plist)} entries for {len(prompts)} prompts: expected one or one each")
        ids = [self.add_request(p, sp, rid=(rids[i] if rids else None))
               for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step(finished_only=True):
                final[out.rid] = out
        return [final[r] for r in ids]

