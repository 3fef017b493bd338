"""One lm-eval run against one OpenAI-compatible endpoint, in its own process.

    python -m specbench.suites.evalparity.worker SPEC.json OUT.json

Contract:
- SPEC is `LmEvalSpec` as JSON. The worker sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (and the
  transformers twin) before lm-eval or datasets are imported, loads only the rendered tasks in
  `include_path` (lm-eval's own task index is never built), and runs `lm_eval.simple_evaluate` with
  `local-completions` and log_samples on.
- OUT is one JSON document: per task its lm-eval version, n, per filter the metric and its stderr as
  lm-eval computed them, and one row per (doc, filter) with the raw generation, the extracted answer,
  the target, the 0/1 score and the prompt's length (tokens counted by the server's /tokenize when the
  backend is remote, so the caller can tell where lm-eval truncated a prompt); plus lm-eval's config,
  its version and the wall time.
- Exit 0 with OUT written, or non-zero with the error on stderr (OUT not written). A separate process
  keeps lm-eval's logging, its global state and the offline switches out of the caller.
- Progress: with `progress_path`, the worker keeps `{"total": T, "done": D}` there (replaced atomically):
  T the requests lm-eval hands its API model (generate_until and loglikelihood: one per document for a
  generation task such as gsm8k), D those answered so far (counted as each API call returns, retries not
  twice). The caller polls it (runner.run_worker).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class LmEvalSpec:
    tasks: list[str]
    include_path: str
    base_url: str  # .../v1/completions
    model: str
    num_fewshot: int | None = None
    limit: int | None = None
    num_concurrent: int = 4
    tokenizer_backend: str = "none"  # none | remote
    max_length: int | None = None  # lm-eval's context budget (remote tokenizer only): prompt + max_gen_toks
    timeout_s: int = 1800
    max_retries: int = 3
    seed: int = 1234
    extra_model_args: dict[str, Any] = field(default_factory=dict)
    progress_path: str | None = None  # where the worker keeps {"total", "done"} (module docstring)

    def model_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model, "base_url": self.base_url,
                                "tokenizer_backend": self.tokenizer_backend,
                                "num_concurrent": self.num_concurrent, "max_retries": self.max_retries,
                                "timeout": self.timeout_s, "seed": self.seed}
        if self.max_length is not None:
            args["max_length"] = self.max_length
        args.update(self.extra_model_args)
        return args

    def model_args_str(self) -> str:
        """The `--model_args` string that reproduces this run with the lm-eval CLI."""
        return ",".join(f"{k}={v}" for k, v in self.model_args().items())


def _prompt(s: dict) -> str | None:
    args = s.get("arguments") or []
    first = args[0] if args else None
    return first[0] if isinstance(first, list | tuple) and first and isinstance(first[0], str) else None


def _sample_row(s: dict, count: Callable[[str], int | None]) -> dict:
    resps = s.get("resps") or [[None]]
    raw = resps[0][0] if resps and resps[0] else None
    filt = s.get("filtered_resps") or [None]
    metric_keys = [m for m in (s.get("metrics") or []) if m in s]
    prompt = _prompt(s)
    return {"doc_id": s["doc_id"], "filter": s["filter"], "target": s.get("target"),
            "raw": raw, "extracted": filt[0], "scores": {m: s[m] for m in metric_keys},
            "prompt_hash": s.get("prompt_hash"), "prompt_chars": len(prompt) if prompt is not None else None,
            "prompt_tokens": count(prompt) if prompt is not None else None,
            "question": (s.get("doc") or {}).get("question")}


def summarize(res: dict, tasks: list[str], count: Callable[[str], int | None] = lambda _: None) -> dict:
    """simple_evaluate's result -> the worker's compact JSON; `count` gives a prompt's token count."""
    out: dict[str, Any] = {}
    for task in tasks:
        metrics = res["results"].get(task, {})
        by_filter: dict[str, dict[str, Any]] = {}
        for key, value in metrics.items():
            if "," not in key:
                continue  # "alias" and the like
            metric, filt = key.split(",", 1)
            if metric.endswith("_stderr"):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            by_filter.setdefault(filt, {})[metric] = {
                "value": value, "stderr": stderr if isinstance(stderr, int | float) else None}
        out[task] = {"version": (res.get("versions") or {}).get(task),
                     "n": (res.get("n-samples") or {}).get(task, {}).get("effective"),
                     "n_shot": (res.get("n-shot") or {}).get(task),
                     "filters": by_filter,
                     "samples": [_sample_row(s, count) for s in (res.get("samples") or {}).get(task, [])]}
    return out


def run(spec: LmEvalSpec) -> dict:
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=spec.include_path, include_defaults=False)
    if spec.progress_path:
        count_requests(Path(spec.progress_path))
    t0 = time.perf_counter()
    res = lm_eval.simple_evaluate(model="local-completions", model_args=spec.model_args(), tasks=spec.tasks,
                                  num_fewshot=spec.num_fewshot, limit=spec.limit, log_samples=True,
                                  task_manager=tm, random_seed=0, numpy_random_seed=1234,
                                  torch_random_seed=1234, fewshot_random_seed=1234)
    wall = time.perf_counter() - t0
    if res is None:
        raise RuntimeError("lm_eval.simple_evaluate returned nothing (not rank 0?)")
    return {"tasks": summarize(res, spec.tasks, _counter(spec)), "wall_s": wall, "lm_eval_version": _version(),
            "model_args": spec.model_args_str(), "config": _jsonable(res.get("config") or {}),
            "spec": asdict(spec)}


class _Tally:
    def __init__(self, path: Path) -> None:
        self.path, self.total, self.done, self.active = path, 0, 0, 0
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"total": self.total, "done": self.done}), encoding="utf-8")
        tmp.replace(self.path)


def count_requests(path: Path) -> _Tally:
    """Wrap lm-eval's API model (TemplateAPI, the base of local-completions) so that `path` holds the requests
    it was handed and those answered: generate_until / loglikelihood add their requests to the total, and each
    model_call / amodel_call made inside them counts its messages when it returns (a retried call raised and
    was not counted; loglikelihood_rolling's own calls are outside both)."""
    from lm_eval.models.api_models import TemplateAPI

    tally = _Tally(path)

    def entry(name: str) -> None:
        orig = getattr(TemplateAPI, name)

        @functools.wraps(orig)
        def wrapped(self: Any, requests: list, *a: Any, **kw: Any) -> Any:
            tally.total += len(requests)
            tally.write()
            tally.active += 1
            try:
                return orig(self, requests, *a, **kw)
            finally:
                tally.active -= 1
        setattr(TemplateAPI, name, wrapped)

    def answered(messages: Any) -> None:
        if tally.active:
            tally.done += len(messages) if isinstance(messages, (list, tuple)) else 1
            tally.write()

    sync_call, async_call = TemplateAPI.model_call, TemplateAPI.amodel_call

    @functools.wraps(sync_call)
    def model_call(self: Any, messages: Any, *a: Any, **kw: Any) -> Any:
        out = sync_call(self, messages, *a, **kw)
        answered(messages)
        return out

    @functools.wraps(async_call)
    async def amodel_call(self: Any, session: Any, sem: Any, messages: Any, *a: Any, **kw: Any) -> Any:
        out = await async_call(self, session, sem, messages, *a, **kw)
        answered(messages)
        return out

    entry("generate_until")
    entry("loglikelihood")
    TemplateAPI.model_call, TemplateAPI.amodel_call = model_call, amodel_call
    return tally


def _counter(spec: LmEvalSpec) -> Callable[[str], int | None]:
    """Prompt token counts through the server's /tokenize (remote backend only), one call per prompt."""
    if spec.tokenizer_backend != "remote":
        return lambda _: None
    import httpx

    root = spec.base_url.removesuffix("/v1/completions")
    client = httpx.Client(timeout=60.0)

    @functools.cache
    def count(prompt: str) -> int | None:
        try:
            r = client.post(f"{root}/tokenize", json={"prompt": prompt, "add_special_tokens": False})
            return len(r.json()["tokens"]) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError):
            return None

    return count


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m specbench.suites.evalparity.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = LmEvalSpec(**json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    out = run(spec)
    tmp = Path(argv[1]).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, default=str), encoding="utf-8")
    tmp.replace(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
