"""`hf` adapter: transformers `generate` as a peer engine (plain, assisted, or prompt lookup).

Contract:
- The model loads with `AutoModelForCausalLM.from_pretrained(model_dir)` in the requested dtype; the
  tokenizer is the engine's wrapper over the same tokenizer.json, so all adapters tokenize alike.
- Requests run one at a time (a lock; `generate` is not batched here): a peer for correctness and
  single-stream speed, not for concurrency numbers.
- Greedy is `do_sample=False`; sampling seeds torch from the request's seed. `ignore_eos` forces
  min_new_tokens = max_tokens. Stop strings are applied after generation: the text is cut before the
  first stop and the ids keep the tokens up to (including) the one that completed the stop string.
- Timings come from a streamer: `put` is called once per committed chunk (one token plain; several per
  step with an assistant model or prompt lookup), so chunk_tokens is exact ("engine").
- Logprobs are log_softmax of the raw logits (`output_logits`), like the reference engine.
- assistant=<dir> uses assisted generation with that model; lookup=N uses prompt_lookup_num_tokens=N.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from .base import EngineAdapter, GenRequest, GenResult, PosLogprobs, ScoreResult, failed


def _dtype_kw() -> str:
    """transformers >= 4.56 spells it dtype=; older versions torch_dtype=."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


class _TimingStreamer:
    """transformers BaseStreamer protocol: put(tokens) per step, end() once. The prompt comes first."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFAdapter(EngineAdapter):
    kind = "hf"

    def __init__(self, model_dir: str, assistant: str | None = None, lookup: int | None = None,
                 device: str = "cpu", dtype: str = "float32", name: str | None = None) -> None:
        import torch

        from specbench.engine.tokenizer import Tokenizer
        from specbench.extras import need

        AutoModelForCausalLM = need("transformers", "hf", "the hf: adapter").AutoModelForCausalLM

        super().__init__(name or ("hf-assisted" if assistant else "hf-lookup" if lookup else "hf"))
        self.model_dir, self.assistant_dir, self.lookup = str(model_dir), assistant, lookup
        self.device, self.dtype = device, dtype
        dt = {_dtype_kw(): getattr(torch, dtype)}

        def load(path: str) -> Any:
            # Any: transformers' stubs type the decorated `.to` as taking the model, not a device
            model: Any = AutoModelForCausalLM.from_pretrained(path, **dt)
            return model.to(device).eval()

        self.model = load(self.model_dir)
        self.assistant = load(assistant) if assistant else None
        self.tokenizer = Tokenizer(self.model_dir)
        self._lock = threading.Lock()

    def _ids(self, req: GenRequest) -> list[int]:
        if req.messages is not None:
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(req.messages))
        return self.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt or [])

    def _run(self, req: GenRequest, rid: str) -> GenResult:
        import torch

        ids = self._ids(req)
        if not ids:
            return failed(req, rid, "prompt is empty: at least one token is required", time.perf_counter())
        kw: dict[str, Any] = {"max_new_tokens": req.max_tokens, "do_sample": req.temperature > 0,
                              "return_dict_in_generate": True, "output_logits": req.logprobs is not None}
        if req.temperature > 0:
            kw.update(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k or None)
            torch.manual_seed(req.seed if req.seed is not None else 0)
        if req.ignore_eos:
            kw["min_new_tokens"] = req.max_tokens
        if self.assistant is not None:
            kw["assistant_model"] = self.assistant
        elif self.lookup:
            kw["prompt_lookup_num_tokens"] = self.lookup
        streamer = _TimingStreamer()
        x = torch.tensor([ids], device=self.device)
        t_send, wall = time.perf_counter(), time.time()
        with self._lock, torch.inference_mode():
            out = self.model.generate(x, attention_mask=torch.ones_like(x), streamer=streamer, **kw)
        t_end = time.perf_counter()
        gen = out.sequences[0, len(ids):].tolist()
        e = self.model.generation_config.eos_token_id
        eos = set(e) if isinstance(e, list) else ({e} if e is not None else set())
        finish = "length"
        if not req.ignore_eos:
            for i, t in enumerate(gen):
                if t in eos:
                    gen, finish = gen[: i + 1], "stop"
                    break
        text = self.tokenizer.decode(gen)
        text, gen, stopped = self._apply_stop(text, gen, req.stop)
        finish = "stop" if stopped else finish
        res = GenResult(rid=rid, ok=True, text=text, output_ids=gen, finish_reason=finish, prompt_tokens=len(ids),
                        completion_tokens=len(gen), t_send=t_send, t_end=t_end, wall_send=wall,
                        meta=dict(req.meta))
        res.chunk_times, res.chunk_tokens = self._trim_chunks(streamer, len(gen))
        res.t_first = res.chunk_times[0] if res.chunk_times else t_end
        if req.logprobs is not None and out.logits:
            res.logprobs = []
            for t, lg in zip(gen, out.logits, strict=False):
                lp = torch.log_softmax(lg[0].float(), -1)
                top = torch.topk(lp, req.logprobs) if req.logprobs else None
                res.logprobs.append(PosLogprobs(token_id=t, logprob=float(lp[t]), top=dict(
                    zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else {}))
        return res

    def _apply_stop(self, text: str, gen: list[int], stops: tuple[str, ...] | list[str]) -> tuple[str, list[int], bool]:
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut < 0:
            return text, gen, False
        for n in range(1, len(gen) + 1):  # the shortest id prefix whose text reaches past the stop's start
            if len(self.tokenizer.decode(gen[:n])) > cut:
                return text[:cut], gen[:n], True
        return text[:cut], gen, True

    @staticmethod
    def _trim_chunks(s: _TimingStreamer, n: int) -> tuple[list[float], list[int]]:
        times, counts, total = [], [], 0
        for t, c in zip(s.times, s.counts, strict=False):
            if total >= n:
                break
            c = min(c, n - total)
            times.append(t)
            counts.append(c)
            total += c
        return times, counts

    async def generate_one(self, req: GenRequest) -> GenResult:
        rid = self._rid(req)
        try:
            return await asyncio.to_thread(self._run, req, rid)
        except Exception as e:
            return failed(req, rid, f"{type(e).__name__}: {e}", time.perf_counter())

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], top_k: int = 1) -> ScoreResult | None:
        import torch

        ids = list(prompt_ids) + list(continuation_ids)
        n = len(prompt_ids)

        def run() -> ScoreResult:
            with self._lock, torch.inference_mode():
                logits = self.model(torch.tensor([ids], device=self.device)).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            out = []
            for i in range(n, len(ids)):
                row = lp[i - 1]
                top = torch.topk(row, top_k) if top_k else None
                out.append(PosLogprobs(token_id=ids[i], logprob=float(row[ids[i]]), top=dict(
                    zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else {}))
            return ScoreResult(out)

        return await asyncio.to_thread(run)

    async def tokenize(self, text: str) -> list[int] | None:
        return self.tokenizer.encode(text)

    def describe(self) -> dict:
        import transformers

        return {"name": self.name, "kind": self.kind, "version": transformers.__version__, "model": self.model_dir,
                "config": {"assistant": self.assistant_dir, "lookup": self.lookup, "device": self.device,
                           "dtype": self.dtype}}
