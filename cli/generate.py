"""`specbench generate`: one-off generation through any adapter, for quick checks.

Contract: builds the adapter from --engine (default: the bundled tiny pair with speculation on), runs
every --prompt as one request (concurrently), prints one JSON document with each result (text, ids,
finish reason, usage, timings, per-request spec metrics, logprobs when asked) and the engine's
description. Exit codes: 0 every request succeeded, 1 some request failed, 2 bad input (an engine
string, an option value).
"""

from __future__ import annotations

import json

import typer


def generate(
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text; repeat for several prompts."),
    engine: str | None = typer.Option(None, "--engine", "-e",
                                      help="Engine string: local[:DIR][,draft=DIR][,spec=...], "
                                           "openai:URL[,model=M], hf:DIR[,assistant=DIR]. "
                                           "Default: the bundled tiny pair, spec on."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
    top_k: int = typer.Option(0, "--top-k", min=0),
    seed: int | None = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeatable."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    logprobs: int | None = typer.Option(None, "--logprobs", min=0, max=20, help="Top-k logprobs per token."),
    chat: bool = typer.Option(False, "--chat", help="Send each prompt as one user message (chat template)."),
    json_out: bool = typer.Option(False, "--json", help="Print the full JSON document (default: a short summary)."),
) -> None:
    """Generate from one engine and print the results (JSON with --json)."""
    from specbench.harness.adapters.base import GenRequest
    from specbench.harness.engines import EngineStringError, build_adapter, default_engines
    from specbench.harness.errors import usage_exit

    try:
        spec = default_engines()[1] if engine is None else engine
        adapter = build_adapter(spec)
    except (EngineStringError, ValueError, FileNotFoundError) as e:
        raise usage_exit("generate", str(e)) from None
    reqs = [GenRequest(prompt=None if chat else p, messages=[{"role": "user", "content": p}] if chat else None,
                       max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                       stop=tuple(stop), ignore_eos=ignore_eos, logprobs=logprobs, rid=f"prompt-{i}")
            for i, p in enumerate(prompt)]
    try:
        results = adapter.generate_sync(reqs)
        desc = adapter.describe()
    finally:
        adapter.close()
    if json_out:
        out = {"engine": desc, "results": [r.to_dict() for r in results]}
        typer.echo(json.dumps(out, default=str))
    else:
        for r in results:
            if not r.ok:
                typer.echo(f"[{r.rid}] FAILED: {r.error}")
                continue
            spec_s = f", accept len {r.spec['mean_accept_len']:.2f}" if r.spec and r.spec.get("mean_accept_len") else ""
            typer.echo(f"[{r.rid}] {r.completion_tokens} tokens, {r.finish_reason}, ttft {1e3 * (r.ttft or 0):.1f} ms, "
                       f"e2e {1e3 * (r.e2el or 0):.1f} ms{spec_s}\n{r.text}")
    if not all(r.ok for r in results):
        raise typer.Exit(1)
