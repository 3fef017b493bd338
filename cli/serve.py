"""`specbench serve`: the reference engine behind an OpenAI-compatible HTTP API (harness/server).

Contract: loads the engine (refusing a bad model/draft/option with exit code 2 and one message naming
it), starts the warm-up (harness/server/warmup.py: every kernel variant and CUDA graph the serving path
uses; /health answers 503 "starting" until it is done; `--no-warmup` skips it), then serves until
SIGINT/SIGTERM. Speculation: dflash when --draft is given, else off, unless
--spec says otherwise. Endpoints and errors: docs/server.md.
"""

from __future__ import annotations

import typer


def serve(
    model: str | None = typer.Option(None, "--model", help="Target model directory (default: the bundled tiny target)."),
    draft: str | None = typer.Option(None, "--draft", help="DFlash drafter directory."),
    spec: str | None = typer.Option(None, "--spec", help="dflash | ngram | off (default: dflash with --draft, else off)."),
    k: int | None = typer.Option(None, "--k", min=1, help="Draft tokens per step (default: block_size-1 / 4 for ngram)."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535),
    device: str = typer.Option("cpu", "--device", help="cpu | cuda | cuda:N"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    served_model_name: str | None = typer.Option(None, "--served-model-name",
                                                 help="Model name clients send (default: the --model path)."),
    max_pending: int = typer.Option(256, "--max-pending", min=1, help="Requests in flight before answering 503."),
    max_model_len: int | None = typer.Option(None, "--max-model-len", min=1),
    num_pages: int | None = typer.Option(None, "--num-pages", min=1, help="KV pages (default: sized by the engine)."),
    log_level: str = typer.Option("info", "--log-level"),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                help="Warm up (compile kernels, capture graphs) before /health reports ready."),
) -> None:
    """Serve the reference engine with an OpenAI-compatible API (/v1/completions, /v1/chat/completions, ...)."""
    from specbench.engine import ConfigError, EngineConfig, LLMEngine, SpecConfig
    from specbench.harness.engines import EngineStringError, bundled
    from specbench.harness.server import serve as run_server
    from specbench.harness.spec_method import SPEC_METHODS, engine_method, spec_method

    if spec is not None and spec not in SPEC_METHODS:
        typer.echo(f"specbench serve: --spec={spec!r} is invalid: expected dflash, ngram or off", err=True)
        raise typer.Exit(2)
    if model is None:
        try:
            model, bdraft = bundled()
        except EngineStringError as e:
            typer.echo(f"specbench serve: {e}", err=True)
            raise typer.Exit(2) from None
        draft = draft or (bdraft if spec in (None, "dflash") else None)
    method = spec_method(spec, draft)
    try:
        cfg = EngineConfig(model=model, draft=draft if method == "dflash" else None, device=device, dtype=dtype,
                           max_model_len=max_model_len, num_pages=num_pages,
                           spec=SpecConfig(method=engine_method(method), num_speculative_tokens=k))
        engine = LLMEngine(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        typer.echo(f"specbench serve: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"specbench serve: {model} (spec={method}) on http://{host}:{port}/v1"
               + ("; warming up, /health answers 200 when ready" if warmup else "; no warm-up"), err=True)
    run_server(engine, host=host, port=port, served_name=served_model_name, max_pending=max_pending,
               log_level=log_level, warmup=warmup)
