"""The adapter contract between suites and engines: typed requests/results and `EngineAdapter`.

Contract:
- `GenRequest` is one generation request (text, token ids or chat messages + sampling). `GenResult` is
  its outcome. A failed request is a `GenResult` with ok=False and `error` set; `generate` never raises
  for a per-request failure, so a run keeps everything already measured.
- Timings are `time.perf_counter()` seconds on the caller's clock: t_send (request handed to the
  engine / written to the socket), t_first (first chunk carrying output), t_end (last chunk / final
  response). `chunk_times[i]` is when chunk i arrived and `chunk_tokens[i]` how many output tokens it
  carried: under speculation a chunk may carry several tokens. `token_count_method` says how the
  per-chunk counts were obtained (see docs/adapters.md).
- `generate(requests, concurrency, on_result)` is closed-loop: at most `concurrency` requests in
  flight (None = all at once); `on_result` is called as each request finishes (completion order), so a
  suite can persist incrementally; the return value is in input order. `offsets` (seconds after the
  start) turn it open-loop: request i is not sent before its offset. Each result's `meta["queue_time"]`:
  seconds from when it was due (its offset, or the call) to its send (client-side waiting for a slot).
- `score` returns teacher-forced top-k logprobs of every continuation position, or None where the
  engine cannot score. `spec_counters` returns a snapshot of cumulative speculative-decoding counters
  (or None); `tokenize` returns token ids (or None); `metrics_text` the engine's Prometheus text (a
  server's /metrics; None where there is none); `describe` returns provenance.
- Prefix caches: `reset_prefix_cache` flushes the engine's prefix cache (True), or returns None where the
  engine has no such control (False: it refused, e.g. while requests hold cached blocks); `cold_requests`
  says whether `GenRequest.prompt_cache=False` keeps a request off every cached block (a fresh salt per
  request: the local engine's `SamplingParams.prompt_cache`, vLLM's `cache_salt`, llama.cpp's `cache_prompt`).
- All async methods are bound to no particular event loop; the `*_sync` wrappers run one in a fresh
  loop and must not be called from inside a running loop.

Capabilities (what only some engines can do; `capabilities` lists the ones an adapter offers, and every
other one raises `UnsupportedCapability` naming the capability and the adapter):
- "faults": `fault_catalogue()` is the engine's catalogue of named faults (name -> `FaultInfo`: what it
  breaks, its family, what its self-test expects; the words are engine/faults.py's); `armable_faults()` the
  ones a gate's self-test arms (name -> what it breaks: every family but "draft_variant", which no gate can
  catch); `with_faults(faults)` builds a fresh engine like this one with those faults armed (none: a fresh
  clean engine). The self-tests prove the gates catch each fault: each takes the faults of its family.
- "decode_window": `decode_window(prompts, max_tokens, warmup)` hands out a `DecodeWindow`, exclusive
  synchronous stepping of an in-process engine whose requests are all past prefill, so a profiler can be
  wrapped around a known number of decode steps.
- "oracle_drafts": `with_oracle_drafts(continuations)` builds a fresh engine like this one (its faults
  armed) whose drafts replay known greedy continuations (prompt ids -> the target's output), every draft
  correct, so a gate can put a stop (EOS, a stop token id) inside an accepted run at will.
- "levers": `with_levers(gate, trim, policy)` builds a fresh engine like this one (its faults armed) with the
  load-aware levers set (engine/config.py SpecConfig gate / trim / policy; None: as this engine has it), so a
  gate can run the paths a lever takes (a gated one-token round, a trimmed draft, the automatic policy).
The local adapter offers all four; remote (openai) and transformers (hf) adapters decline.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import latency
from ..errors import Refusal

OnResult = Callable[["GenResult"], Awaitable[None] | None]


@dataclass
class GenRequest:
    """One generation request. Exactly one of `prompt` (text or token ids) and `messages` is set."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()  # generation ends after any of these ids (vLLM-style)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per output position (None = off)
    # vLLM's penalties (1 / 0 = off): repetition over the prompt and output, presence / frequency over the output
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # OpenAI's: token id -> bias in [-100, 100] on the logits
    min_tokens: int = 0  # vLLM's: no EOS / stop token id / stop before this many output tokens (0 = off)
    rid: str | None = None
    meta: dict = field(default_factory=dict)  # opaque to adapters; copied into the result
    prompt_cache: bool | None = None  # reuse a cached prompt prefix (None = the engine's default; gates send False)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("GenRequest: set exactly one of prompt= (text or token ids) and messages=")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop or ())
        self.stop_token_ids = tuple(int(t) for t in (self.stop_token_ids or ()))


@dataclass
class PosLogprobs:
    """Logprobs of one position: the chosen (or teacher-forced) token and the top-k alternatives."""

    token_id: int | None
    logprob: float | None
    top: dict[int, float] = field(default_factory=dict)
    token: str | None = None  # the token's text where the engine reports strings, not ids
    top_text: dict[str, float] | None = None  # top-k keyed by token text, when ids are not reported


# GenResult.token_count_method values (docs/adapters.md) whose chunk_tokens are exact counts: the engine's own
# steps, and a stream's token_ids, logprobs entries or running usage; "proportional" and "chunks" are estimates.
EXACT_CHUNK_METHODS = ("engine", "token_ids", "logprobs", "usage")


def counted_exactly(method: str | None) -> bool:
    """Whether a result's `chunk_tokens` are exact counts: its `token_count_method` (a '+'-joined set of methods
    where several applied) names exact methods only."""
    parts = [m for m in str(method or "").split("+") if m]
    return bool(parts) and all(m in EXACT_CHUNK_METHODS for m in parts)


@dataclass
class GenResult:
    rid: str
    ok: bool
    error: str | None = None
    text: str = ""
    output_ids: list[int] | None = None  # None where the engine does not report ids
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    logprobs: list[PosLogprobs] | None = None
    # the prompt token ids the engine reports it computed (a chat request's rendered template: vLLM's
    # return_token_ids `prompt_token_ids`); None where it reports none
    prompt_ids: list[int] | None = None
    t_send: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    wall_send: float = 0.0  # time.time() at send, for ordering across processes
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_count_method: str = "engine"
    spec: dict | None = None  # per-request spec metrics where the engine reports them
    attempts: int = 1
    meta: dict = field(default_factory=dict)

    # The metrics below are harness/latency.py's, fed this result's own times: TTFT from t_first, E2EL from t_end
    # (the adapter's end of the response; a stored record's `derive` ends E2EL at the last counted chunk).
    @property
    def ttft(self) -> float | None:
        return latency.since(self.t_send, self.t_first)

    @property
    def drafted(self) -> int | None:
        """Draft tokens this request carried where the engine reports them per request (llama.cpp's timings give
        tokens, not rounds), else its draft rounds, else None."""
        sp = self.spec or {}
        n = sp.get("num_draft_tokens", sp.get("num_drafts"))
        return int(n) if n is not None else None

    @property
    def e2el(self) -> float | None:
        return latency.since(self.t_send, self.t_end)

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (completion_tokens - 1), REFERENCE.md section 3 (`latency.tpot`)."""
        return latency.tpot(self.ttft, self.e2el, self.completion_tokens)

    def _counted_chunks(self) -> list[tuple[float, int]]:
        """(offset from the send, tokens) of the chunks that carried counted tokens, as a stored record's."""
        return latency.counted_chunks(latency.offsets(self.t_send, self.chunk_times), self.chunk_tokens,
                                      self.completion_tokens)

    def token_itls(self) -> list[float]:
        """Per-token inter-token latencies: each gap between chunks that carried counted tokens spread evenly
        over the later chunk's tokens (`latency.token_itls`)."""
        return latency.token_itls(self._counted_chunks())

    def chunk_gaps(self) -> list[float]:
        """The raw gaps between chunks that carried counted tokens (`latency.chunk_gaps`)."""
        return latency.chunk_gaps(self._counted_chunks())

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, e2el=self.e2el, tpot=self.tpot)
        return d


@dataclass
class ScoreResult:
    """Teacher-forced logprobs of each continuation token given everything before it."""

    positions: list[PosLogprobs]

    @property
    def total(self) -> float:
        return sum(p.logprob or 0.0 for p in self.positions)

    @property
    def is_greedy(self) -> bool:
        return all(p.top and p.logprob is not None and p.logprob >= max(p.top.values()) - 1e-6
                   for p in self.positions)


def failed(req: GenRequest, rid: str, error: str, t_send: float, attempts: int = 1) -> GenResult:
    return GenResult(rid=rid, ok=False, error=error, t_send=t_send, t_end=time.perf_counter(),
                     wall_send=time.time(), attempts=attempts, meta=dict(req.meta))


FAULTS = "faults"
DECODE_WINDOW = "decode_window"
ORACLE_DRAFTS = "oracle_drafts"
LEVERS = "levers"
CAPABILITIES = (FAULTS, DECODE_WINDOW, ORACLE_DRAFTS, LEVERS)


@dataclass(frozen=True)
class FaultInfo:
    """One named fault as the engine describes it (engine/faults.py FAMILIES and EXPECTS hold the words)."""

    description: str  # what it breaks
    family: str  # which self-test proves it caught: greedy, sampling, prefix, draft_variant
    expect: str = "fail"  # what that self-test expects with it armed: fail, fallback (prefix), acceptance


class UnsupportedCapability(NotImplementedError):
    """An adapter declined a capability. The message names the capability, the adapter and who offers it."""

    def __init__(self, adapter: EngineAdapter, capability: str, why: str | None = None) -> None:
        self.capability, self.adapter_kind, self.adapter_name = capability, adapter.kind, adapter.name
        why = why or ("it needs the reference engine in this process, which only the local adapter has: "
                      "use a local:<model_dir> engine string")
        super().__init__(f"the {adapter.kind} adapter {adapter.name!r} does not offer the {capability!r} "
                         f"capability: {why}")


class DecodeWindow(ABC):
    """Exclusive, synchronous stepping of an in-process engine; every request in it is past prefill.

    Nothing else steps the engine while the window is open, so what a profiler records around `step()`
    calls is exactly those steps. `phase_ranges` says whether each step opens the named phase ranges
    (schedule, draft, verify or forward, accept, commit) that `specbench gaps --phases` reads back.
    """

    device: str = "cpu"
    phase_ranges: bool = False

    @abstractmethod
    def step(self) -> int:
        """Run one engine step; returns the number of output tokens it emitted."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """Whether any request of the window is unfinished."""


class EngineAdapter(ABC):
    """Uniform access to one engine. Subclasses implement `generate_one` and what they can of the rest."""

    kind: str = "base"
    capabilities: frozenset[str] = frozenset()  # which of CAPABILITIES this adapter offers

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.kind
        self._n = 0

    def _rid(self, req: GenRequest) -> str:
        self._n += 1
        return req.rid or f"{self.name}-{self._n}"

    @abstractmethod
    async def generate_one(self, req: GenRequest) -> GenResult:
        """Run one request; per-request failures are returned as ok=False, not raised."""

    async def generate(self, requests: Sequence[GenRequest], concurrency: int | None = None,
                       on_result: OnResult | None = None,
                       offsets: Sequence[float] | None = None) -> list[GenResult]:
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency={concurrency} is invalid: expected an integer >= 1 or None")
        if offsets is not None and len(offsets) != len(requests):
            raise ValueError(f"offsets has {len(offsets)} entries for {len(requests)} requests")
        sem = asyncio.Semaphore(concurrency or max(1, len(requests)))
        t0 = time.perf_counter()
        results: list[GenResult | None] = [None] * len(requests)

        async def one(i: int, req: GenRequest) -> None:
            if offsets is not None:
                await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            due = time.perf_counter()  # the request is due now; waiting for a slot is client-side queueing
            async with sem:
                try:
                    res = await self.generate_one(req)
                except (asyncio.CancelledError, Refusal):  # a refusal (harness/errors.py) ends the command
                    raise
                except Exception as e:  # an adapter bug must not lose the rest of the run
                    res = failed(req, req.rid or f"{self.name}-{i}", f"{type(e).__name__}: {e}", time.perf_counter())
            res.meta.setdefault("queue_time", max(0.0, res.t_send - due) if res.t_send else 0.0)
            results[i] = res
            if on_result is not None:
                r = on_result(res)
                if inspect.isawaitable(r):
                    await r

        tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return [r for r in results if r is not None]

    def generate_sync(self, requests: Sequence[GenRequest], concurrency: int | None = None,
                      on_result: OnResult | None = None, offsets: Sequence[float] | None = None) -> list[GenResult]:
        return asyncio.run(self.generate(requests, concurrency, on_result, offsets))

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        return None

    async def spec_counters(self) -> dict | None:
        """{num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos, source} or None."""
        return None

    async def tokenize(self, text: str) -> list[int] | None:
        return None

    async def metrics_text(self) -> str | None:
        """The engine's Prometheus text (a server's /metrics), or None where it publishes none."""
        return None

    async def reset_prefix_cache(self) -> bool | None:
        """Flush the engine's prefix cache: True when flushed, False when it refused, None where it cannot."""
        return None

    def cold_requests(self) -> bool:
        """Whether a request with prompt_cache=False shares no cached block (module docstring)."""
        return False

    @abstractmethod
    def describe(self) -> dict:
        """Provenance: at least name, kind, version, model and config."""

    async def aclose(self) -> None:
        return None

    def run(self, coro: Awaitable[Any]) -> Any:
        """Run one of this adapter's coroutines to completion from synchronous code."""

        async def _main() -> Any:
            return await coro

        return asyncio.run(_main())

    # ---- capabilities (module docstring); the defaults decline -------------------------------------
    def fault_catalogue(self) -> dict[str, FaultInfo]:
        """Every named fault of the engine: name -> what it breaks, its family, what its self-test expects."""
        raise UnsupportedCapability(self, FAULTS)

    def armable_faults(self) -> dict[str, str]:
        """The faults a gate's self-test arms: name -> what it breaks, every family but the drafter variants
        (lossless by construction, so no gate can catch them; check-draft arms those through `with_faults`)."""
        return {k: f.description for k, f in self.fault_catalogue().items() if f.family != "draft_variant"}

    def with_faults(self, faults: Sequence[str], name: str | None = None) -> EngineAdapter:
        """A fresh engine like this one with `faults` armed (empty: clean); named `name`, else
        `<this name>[<fault>+...]`. Works on a closed adapter too; the caller closes the new one."""
        raise UnsupportedCapability(self, FAULTS)

    def with_oracle_drafts(self, continuations: Mapping[tuple[int, ...], Sequence[int]],
                           name: str | None = None) -> EngineAdapter:
        """A fresh engine like this one (the same config, its faults armed) whose proposer replays
        `continuations` (prompt token ids -> the target's greedy output ids): every draft is the target's own
        next token until the known continuation ends (then filler, rejected), so every verify step accepts
        all K drafts. Requests for other prompts get filler drafts. The caller closes it."""
        raise UnsupportedCapability(self, ORACLE_DRAFTS)

    def with_levers(self, gate: int | None = None, trim: int | None = None, policy: str | None = None,
                    name: str | None = None) -> EngineAdapter:
        """A fresh engine like this one (the same config, its faults armed) with the load-aware levers given
        (None: as this engine has it); named `name`, else `<this name>[<lever>=<value>...]`. The caller closes it."""
        raise UnsupportedCapability(self, LEVERS)

    def decode_window(self, prompts: Sequence[str], max_tokens: int,
                      warmup: int = 0) -> AbstractContextManager[DecodeWindow]:
        """Admit `prompts` (greedy, ignore_eos, `max_tokens` each), step them past prefill and `warmup` more
        steps, then hand out the window; on exit whatever is unfinished is aborted."""
        raise UnsupportedCapability(self, DECODE_WINDOW)

    def score_sync(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        return self.run(self.score(prompt_ids, continuation_ids, top_k))

    def spec_counters_sync(self) -> dict | None:
        return self.run(self.spec_counters())

    def tokenize_sync(self, text: str) -> list[int] | None:
        return self.run(self.tokenize(text))

    def close(self) -> None:
        self.run(self.aclose())


def counters_delta(before: dict | None, after: dict | None) -> dict | None:
    """after - before for the cumulative spec counters (per-position lists padded to equal length)."""
    if before is None or after is None:
        return None
    out: dict = {"source": after.get("source")}
    for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_full_accepts"):
        if after.get(k) is not None and before.get(k) is not None:
            out[k] = after[k] - before[k]
    a, b = list(after.get("accepted_per_pos") or []), list(before.get("accepted_per_pos") or [])
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    out["accepted_per_pos"] = [x - y for x, y in zip(a, b, strict=True)]
    if after.get("gated_rounds") is not None and before.get("gated_rounds") is not None:  # load-aware levers
        out["gated_rounds"] = after["gated_rounds"] - before["gated_rounds"]
    if isinstance(after.get("span_hist"), dict):
        hb = before.get("span_hist") or {}
        out["span_hist"] = {s: n - hb.get(s, 0) for s, n in after["span_hist"].items() if n - hb.get(s, 0)}
    if isinstance(after.get("policy_state"), dict):  # a snapshot at the end, not a difference
        out["policy_state"] = after["policy_state"]
    return out


def synthetic_tau_of(describe: dict) -> float | None:
    """The synthetic acceptance tau an engine runs with (engine/spec/synthetic.py: drawn acceptance, outputs that
    are not the target's), from its `describe()`: a local engine's config, or a `specbench serve --synthetic-tau`
    server's /v1/models entries. None: it speculates for real (or says nothing)."""
    tau = (describe.get("config") or {}).get("synthetic_tau") if isinstance(describe.get("config"), dict) else None
    if tau is None:
        models = ((describe.get("server") or {}).get("models") or []) if isinstance(describe.get("server"), dict) else []
        taus = [m.get("synthetic_tau") for m in models if isinstance(m, dict) and m.get("synthetic_tau") is not None]
        tau = taus[0] if taus else None
    return float(tau) if tau is not None else None


def refuse_synthetic(engines: dict[str, dict], suite: str, error: type[Exception]) -> None:
    """A correctness gate cannot judge an engine whose acceptance is drawn: refuse it up front, naming the arm."""
    for arm, d in engines.items():
        tau = synthetic_tau_of(d or {})
        if tau is not None:
            raise error(f"{arm} runs synthetic acceptance (tau={tau:g}: the number of accepted drafts is drawn, so "
                        f"its outputs are not the target's): {suite} cannot judge it; drop tau= from the engine "
                        "string or --synthetic-tau from `specbench serve` (synthetic acceptance is for speed curves)")
