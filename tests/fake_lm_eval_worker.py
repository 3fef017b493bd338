"""Stands in for suites/evalparity/worker.py where lm-eval is not installed (tests/test_progress.py): a fake
`lm_eval.models.api_models.TemplateAPI` shaped like lm-eval 0.4's (generate_until hands each request to
amodel_call with keyword arguments, as with num_concurrent > 1), wrapped by the worker's real
`count_requests`, answers `limit` gsm8k documents with a short pause each and writes OUT as the worker does.

    python -m fake_lm_eval_worker SPEC.json OUT.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import types
from pathlib import Path

PAUSE_S = 0.05


class TemplateAPI:
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        async def each() -> list[list[str]]:
            return [await self.amodel_call(session=None, sem=None, messages=[r], generate=True) for r in requests]
        return [a[0] for a in asyncio.run(each())]

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        return [self.model_call(messages=[r], generate=False) for r in requests]

    def model_call(self, messages: list, *, generate: bool = True, **kw: object) -> dict:
        return {"choices": [{"text": "x"} for _ in messages]}

    async def amodel_call(self, session: object, sem: object, messages: list, **kw: object) -> list[str]:
        await asyncio.sleep(PAUSE_S)
        return ["work #### 7" for _ in messages]


def _install_fake_lm_eval() -> None:
    api = types.ModuleType("lm_eval.models.api_models")
    api.TemplateAPI = TemplateAPI  # type: ignore[attr-defined]
    sys.modules.update({"lm_eval": types.ModuleType("lm_eval"), "lm_eval.models": types.ModuleType("lm_eval.models"),
                        "lm_eval.models.api_models": api})


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    _install_fake_lm_eval()
    from specbench.suites.evalparity.worker import count_requests

    if spec.get("progress_path"):
        count_requests(Path(spec["progress_path"]))
    t0 = time.perf_counter()
    n = spec.get("limit") or 5
    answers = TemplateAPI().generate_until(list(range(n)))
    samples = [{"doc_id": i, "filter": f, "target": "work\n7", "raw": a, "extracted": "7",
                "scores": {"exact_match": 1.0}, "prompt_hash": str(i)}
               for f in ("strict-match", "flexible-extract") for i, a in enumerate(answers)]
    filters = {f: {"exact_match": {"value": 1.0, "stderr": 0.0}} for f in ("strict-match", "flexible-extract")}
    out = {"tasks": {"gsm8k": {"version": 3.0, "n": n, "n_shot": 0, "filters": filters, "samples": samples}},
           "wall_s": time.perf_counter() - t0, "lm_eval_version": "fake", "model_args": "fake", "config": {},
           "spec": spec}
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
