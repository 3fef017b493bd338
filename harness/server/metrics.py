"""`/metrics` through prometheus_client: vLLM's metric names, labels and histogram buckets.

Contract:
- `ServerMetrics(loop, model_name)` owns one `CollectorRegistry` per app (no process-global registry, so
  two servers in one process never mix) and `render()` returns (body, content type) in the Prometheus text
  format; prometheus_client does the formatting and the label escaping (a served name with quotes,
  backslashes or newlines stays one well-formed label).
- Labels: `model_name` (the served name) and `engine="0"`, as vLLM v1; per-position acceptance adds
  `position`, `vllm:request_success_total` adds `finished_reason` (stop | length | abort | error).
- Counters and gauges of the engine are read at each scrape by a collector (`EngineCollector`), never
  cached: running / waiting come from the scheduler's queues, KV usage and free pages from the pool, so
  after aborts and disconnects they read what the engine holds now (0 and a full pool once idle). An engine in
  a process of its own is asked for one fresh snapshot per scrape (`ProcEngine.refresh`), so a scrape sent after a
  response was answered counts that request (a snapshot cached for 50 ms left the counters one request short).
- Histograms are observed on the engine-loop thread through `EngineLoop`'s observers: queue time when a
  request is first scheduled; TTFT, inter-token latency (one observation per step that emitted tokens:
  several tokens of one verify step arrive together, as in vLLM), time per output token, E2E, prefill and
  decode time, prompt / generation length and the tokens committed per verify step when it finishes.
  Latencies run from the moment the server received the HTTP request (tokenization included) where the
  consumer says so, else from the engine's arrival. A request aborted or failed is counted in
  `request_success_total{finished_reason="abort"|"error"}` and observed in no histogram.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..adapters.loop import num_waiting

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so its Grafana dashboards read ours as theirs
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
LABELS = ("model_name", "engine")


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out: list[float] = []
    mant, exp = [1, 2, 5], 0
    while True:
        for m in mant:
            v = m * 10 ** exp
            if v > limit:
                return out
            out.append(float(v))
        exp += 1


class EngineCollector(Collector):
    """The engine's counters and live gauges, read at each scrape."""

    def __init__(self, loop: Any, labels: tuple[str, str]) -> None:
        self.loop, self.labels = loop, list(labels)

    def collect(self) -> Iterator[Metric]:
        # every figure as of this scrape: an engine in a process of its own (engine_proc.py) fetches a fresh snapshot
        # here, once, and the reads below share it; a cached one could predate the last answered request
        e = self.loop.engine
        fresh = getattr(e, "refresh", None)
        if callable(fresh):
            fresh()
        m = e.metrics
        lab, names = self.labels, list(LABELS)

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(lab, value)
            return c

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(lab, value)
            return g

        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts (verify steps with drafts).",
                      m.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", m.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", m.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*names, "position"])
        for i, v in enumerate(list(m.accepted_per_pos)):
            per_pos.add_metric([*lab, str(i)], v)
        yield per_pos
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", m.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", m.generation_tokens)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      getattr(m, "prefix_queries", 0))
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      getattr(m, "prefix_hits", 0))
        yield counter("specbench:spec_capture_hits", "Prefix hits whose drafter context was restored.",
                      getattr(m, "capture_hits", 0))
        yield counter("specbench:spec_capture_fallbacks",
                      "Prefix hits without the drafter's capture: the request decodes without drafts.",
                      getattr(m, "capture_fallbacks", 0))
        yield counter("specbench:decode_ahead_steps",
                      "Decode steps launched one ahead: plain decode, and gated rounds with speculation on (engine/ahead.py; decode_ahead=0 / gated_ahead=0 turn them off).",
                      getattr(m, "decode_ahead_steps", 0))
        # load-aware speculation (engine/spec/policy.py): one-token rounds and steps per chosen verify span
        yield counter("specbench:spec_gated_rounds",
                      "Steps whose draft-ready requests verified one token (max-batch gate or span policy).",
                      getattr(m, "gated_rounds", 0))
        spans = CounterMetricFamily("specbench:spec_step_span", "Steps per chosen verify span (1 + drafts).",
                                    labels=[*names, "span"])
        for span, n in sorted(dict(getattr(m, "span_hist", {}) or {}).items()):
            spans.add_metric([*lab, str(span)], n)
        yield spans
        sched, pool = getattr(e, "scheduler", None), getattr(e, "pool", None)
        running = len(sched.running) if sched is not None else m.num_running
        waiting = num_waiting(e) if sched is not None else m.num_waiting  # the admission inbox included
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        if pool is not None:
            free, total = pool.num_free, pool.num_pages
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                        1.0 - free / total if total else 0.0)
            yield gauge("specbench:kv_pages_free", "Free pages in the KV pool.", free)
            yield gauge("specbench:kv_pages_total", "Pages in the KV pool.", total)
        else:
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m.kv_usage)
        yield gauge("specbench:requests_in_flight", "Requests admitted by the server and not finished.",
                    self.loop.num_pending)


class ServerMetrics:
    def __init__(self, loop: Any, model_name: str, k_max: int = 16) -> None:
        self.loop = loop
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = (model_name, "0")
        self.registry.register(EngineCollector(loop, self.labels))
        r, lab = self.registry, LABELS
        max_len = int(getattr(loop.engine, "max_model_len", 1 << 20) or 1 << 20)
        self.success = Counter("vllm:request_success", "Count of finished requests, by finish reason.",
                               [*lab, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # every series exists from the first scrape, at 0
            self.success.labels(*self.labels, reason)

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(name, doc, lab, buckets=tuple(buckets), registry=r).labels(*self.labels)

        self.queue = hist("vllm:request_queue_time_seconds", "Time spent waiting to be scheduled, in seconds.",
                          REQUEST_BUCKETS)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token, in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between engine steps that emitted tokens of "
                        "one request, in seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Decode time per output token after the first, in seconds.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency, in seconds.",
                        REQUEST_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Scheduled to first token, in seconds.",
                            REQUEST_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to last token, in seconds.",
                           REQUEST_BUCKETS)
        self.n_prompt = hist("vllm:request_prompt_tokens", "Prompt length of finished requests.",
                             buckets_1_2_5(max_len))
        self.n_gen = hist("vllm:request_generation_tokens", "Generated tokens of finished requests.",
                          buckets_1_2_5(max_len))
        self.per_step = hist("specbench:spec_decode_tokens_per_step",
                             "Tokens committed by one verify step of one request (1 + accepted drafts).",
                             [float(i) for i in range(1, k_max + 2)])
        self._scheduled_at: dict[str, float] = {}
        self.aborts = 0  # aborted + failed requests (the shutdown summary)
        loop.on_finish, loop.on_abort, loop.on_scheduled = self.finished, self.aborted, self.scheduled

    # ---- observers (engine-loop thread) ----------------------------------------------------------
    def scheduled(self, rid: str, queue_s: float) -> None:
        self.queue.observe(queue_s)
        self._scheduled_at[rid] = queue_s

    def aborted(self, rid: str, reason: str) -> None:
        self._scheduled_at.pop(rid, None)
        self.aborts += 1
        self.success.labels(*self.labels, reason).inc()

    def finished(self, out: Any, sub: Any) -> None:
        queue_s = self._scheduled_at.pop(out.rid, None)
        reason = out.finish_reason if out.finish_reason in FINISH_REASONS else "stop"
        self.success.labels(*self.labels, reason).inc()
        times = list(out.token_times)
        t0 = sub.received or out.arrival
        if not times:
            return
        self.ttft.observe(max(0.0, times[0] - t0))
        self.e2e.observe(max(0.0, times[-1] - t0))
        steps = sorted(set(times))  # the tokens of one step share its emission time
        for a, b in zip(steps, steps[1:], strict=False):
            self.itl.observe(b - a)
        if len(times) > 1:
            self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))
        if queue_s is not None:
            self.prefill.observe(max(0.0, times[0] - (sub.submitted + queue_s)))
        self.decode.observe(times[-1] - times[0])
        self.n_prompt.observe(len(out.prompt_ids))
        self.n_gen.observe(len(out.output_ids))
        for m in (out.spec or {}).get("accepted_runs", ()):
            self.per_step.observe(1 + m)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
