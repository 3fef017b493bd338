"""A speculating endpoint seen through its adapter, for the sweep's acceptance / metrics audit: honest, late, or
lying in one named way, with everything decided by counts (requests served, /metrics scrapes), never by time.

`SpecFake(name, lie=..., lag=..., ...)` is an `EngineAdapter` of the openai kind: every request streams a first
chunk of one token (the prefill), then chunks of `step` tokens, each one verify step of `k` drafts with step - 1
accepted (the last chunk may be shorter), up to max_tokens. What it did is counted exactly (requests, output and
prompt tokens, verify steps, draft and accepted tokens, per position) and published in vLLM's names by
`metrics_text()` (which `spec_counters()` reads too, as an openai adapter's /metrics scrape would):

- `lag=N`: a request's counts appear only N scrapes after its answer (a server that publishes late, healthy);
- `lie="drop_request"`: the `drop_at`-th generation request (1-based, the sweep's one-token probe included) is
  never counted: one request missing, its tokens with it;
- `lie="double_tokens"`: every output token counted twice;
- `lie="overstate"`: every drafted token counted as accepted (acceptance 100 %, per position too);
- `moving=True`: another client's request finishes before every scrape (counters that never settle);
- `foreign_at=N`: another client's request (with its tokens) finishes together with the N-th request.
`per_step=True` describes the endpoint as `specbench serve` (one streamed event per engine step, judged per
chunk); else as vLLM. `per_request=True` puts each request's own draft counts in its result, as
`specbench serve` does.
"""

from __future__ import annotations

import time

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult
from specbench.harness.adapters.prom import spec_counters_from_metrics

LIES = ("drop_request", "double_tokens", "overstate")


class SpecFake(EngineAdapter):
    kind = "openai"

    def __init__(self, name: str, k: int = 3, step: int = 3, lag: int = 0, lie: str | None = None,
                 drop_at: int = 3, moving: bool = False, foreign_at: int | None = None, per_step: bool = True,
                 per_request: bool = False) -> None:
        super().__init__(name)
        if lie is not None and lie not in LIES:
            raise ValueError(f"lie={lie!r}: expected one of {LIES}")
        self.model = "fake"
        self.k, self.step, self.lag, self.lie, self.drop_at = k, step, lag, lie, drop_at
        self.moving, self.foreign_at, self.per_step, self.per_request = moving, foreign_at, per_step, per_request
        self.served = 0  # generation requests answered
        self.scrapes = 0
        self.pending: list[tuple[int, dict]] = []  # (published at scrape, counts)
        self.published = {"requests": 0, "gen": 0, "prompt": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0}
        self.per_pos = [0] * k

    # ---- serving -------------------------------------------------------------------------------------
    def _counts(self, n_out: int, n_prompt: int) -> tuple[dict, list[int], list[int]]:
        """One request of n_out tokens: its counts, its chunk sizes and its accepted run per verify step."""
        chunks, runs, left = [1], [], n_out - 1
        while left > 0:
            c = min(self.step, left)
            chunks.append(c)
            runs.append(min(c - 1, self.k))
            left -= c
        counts = {"requests": 1, "gen": n_out, "prompt": n_prompt, "drafts": len(runs),
                  "draft_tokens": self.k * len(runs), "accepted": sum(runs), "runs": runs}
        return counts, chunks, runs

    def _publish(self, counts: dict) -> None:
        for key in self.published:
            self.published[key] += counts[key]
        for m in counts["runs"]:
            for i in range(m):
                self.per_pos[i] += 1

    async def generate_one(self, req: GenRequest) -> GenResult:
        t0 = time.perf_counter()
        n_prompt = len(req.prompt) if isinstance(req.prompt, list) else len(str(req.prompt).split())
        n_out = int(req.max_tokens)
        counts, chunks, runs = self._counts(n_out, n_prompt)
        self.served += 1
        if not (self.lie == "drop_request" and self.served == self.drop_at):
            self.pending.append((self.scrapes + self.lag, counts))
        if self.foreign_at == self.served:
            self.pending.append((self.scrapes + self.lag, self._counts(5, 7)[0]))
        now = time.perf_counter()
        res = GenResult(rid=self._rid(req), ok=True, t_send=t0, wall_send=time.time(), meta=dict(req.meta),
                        prompt_tokens=n_prompt, completion_tokens=n_out, finish_reason="length",
                        chunk_times=[now] * len(chunks), chunk_tokens=chunks, token_count_method="token_ids",
                        t_first=now, t_end=now)
        if self.per_request:
            res.spec = {"num_drafts": len(runs), "num_draft_tokens": self.k * len(runs),
                        "num_accepted_tokens": sum(runs),
                        "accepted_per_pos": [sum(1 for m in runs if m > i) for i in range(self.k)]}
        return res

    async def tokenize(self, text: str) -> list[int]:
        return [3 + len(w) % 50 for w in text.split()] or [3]

    # ---- what the server publishes -------------------------------------------------------------------------
    async def metrics_text(self) -> str:
        self.scrapes += 1
        if self.moving:
            self.pending.append((self.scrapes, self._counts(5, 7)[0]))
        due = [c for at, c in self.pending if at <= self.scrapes]
        self.pending = [(at, c) for at, c in self.pending if at > self.scrapes]
        for c in due:
            self._publish(c)
        p = self.published
        gen = p["gen"] * (2 if self.lie == "double_tokens" else 1)
        accepted = p["draft_tokens"] if self.lie == "overstate" else p["accepted"]
        per_pos = [p["drafts"]] * self.k if self.lie == "overstate" else self.per_pos
        lab = f'model_name="{self.model}"'
        lines = [f'vllm:request_success_total{{{lab},finished_reason="length"}} {p["requests"]}',
                 f'vllm:request_success_total{{{lab},finished_reason="abort"}} 0',
                 f"vllm:generation_tokens_total{{{lab}}} {gen}",
                 f"vllm:prompt_tokens_total{{{lab}}} {p['prompt']}",
                 f"vllm:num_requests_running{{{lab}}} 0", f"vllm:num_requests_waiting{{{lab}}} 0",
                 f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
                 f"vllm:spec_decode_num_drafts_total{{{lab}}} {p['drafts']}",
                 f"vllm:spec_decode_num_draft_tokens_total{{{lab}}} {p['draft_tokens']}",
                 f"vllm:spec_decode_num_accepted_tokens_total{{{lab}}} {accepted}"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {v}'
                  for i, v in enumerate(per_pos)]
        return "\n".join(lines) + "\n"

    async def spec_counters(self) -> dict | None:
        return spec_counters_from_metrics(await self.metrics_text(), self.model)

    def describe(self) -> dict:
        return {"name": self.name, "kind": "openai", "version": "0", "model": self.model,
                "dialect": "specbench" if self.per_step else "vllm", "config": {"k": self.k}}
