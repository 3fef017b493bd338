"""`specbench serve`: the reference engine behind an OpenAI-compatible HTTP API (harness/server).

Contract: checks the model and drafter directories and the options, then binds the port (cli/serve_checks.py:
a missing directory or a bad option exits 2, a busy port 3, each in one line and within 2 s, before torch
is imported), loads the engine (refusing a bad model/draft/option with exit code 2 and one message naming
it) and probes its chat template in the sandbox, bounded as requests are (--chat-template-timeout; a template
that trips a bound on a plain conversation is refused: exit 2, one line), starts the warm-up (harness/server/warmup.py: every kernel
variant and CUDA graph the serving path uses; /health answers 503 "starting" until it is done;
`--no-warmup` skips it), then serves until SIGINT/SIGTERM (then drains for --shutdown-timeout seconds and
exits 0 with one line; harness/server/lifecycle.py). Speculation: dflash when --draft is given, else off, unless
--spec says otherwise; --spec-gate / --spec-trim / --spec-policy are the load-aware levers (engine/spec/policy.py),
refused at start (exit 2, naming the knob) when out of range. The engine runs in a process of its own unless
--no-engine-process or SPECBENCH_ENGINE_PROCESS=0 (harness/server/engine_proc.py: the step loop then shares no
GIL with the HTTP side). Endpoints and errors: docs/server.md.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from specbench import env

# The engine steps on its own thread beside the event loop; after each GPU wait it needs the GIL back, and a busy
# event loop may keep it for up to the switch interval. Measured on the H200 (reports/h200-serve): 0.5 ms instead of
# Python's 5 ms changed nothing beyond the noise at c1-c64, so the default stays Python's own; the knob is for
# experiments on other machines.
DEFAULT_GIL_SWITCH_MS = env.default("SPECBENCH_GIL_SWITCH_MS")  # 5.0: Python's own
# The engine and its step loop in a process of their own (harness/server/engine_proc.py): measured on the H200, the
# in-process server made 0.71x the engine's own tok/s at c64 (the step thread waits for the GIL behind the HTTP side).
ENGINE_PROCESS_ENV = "SPECBENCH_ENGINE_PROCESS"
DEFAULT_ENGINE_PROCESS = env.default(ENGINE_PROCESS_ENV)  # on


def engine_process_choice(flag: bool | None) -> bool:
    """--engine-process/--no-engine-process, else $SPECBENCH_ENGINE_PROCESS (0 | 1), else the default; another
    value of the variable is a ValueError naming it and what it accepts."""
    return flag if flag is not None else env.flag(ENGINE_PROCESS_ENV)


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
    spec_gate: int | None = typer.Option(None, "--spec-gate", min=0,
                                         help="Max-batch gate: one-token rounds (drafter context kept) while more than N "
                                              "requests run (0 = off; default $SPECBENCH_SPEC_GATE)."),
    spec_trim: int | None = typer.Option(None, "--spec-trim", min=0,
                                         help="Draft trim: k <= K drafts enter each verify span (0 = off; default "
                                              "$SPECBENCH_SPEC_TRIM)."),
    spec_policy: str | None = typer.Option(None, "--spec-policy",
                                           help="off | auto: each step's span from the start-up cost model and the "
                                                "running acceptance (default $SPECBENCH_SPEC_POLICY, else off)."),
    prefix_cache: bool | None = typer.Option(None, "--prefix-cache/--no-prefix-cache",
                                             help="Share the KV of full blocks between requests with the same prefix "
                                                  "(default $SPECBENCH_PREFIX_CACHE, else on; docs/prefix-cache.md)."),
    prefix_cache_pages: int | None = typer.Option(None, "--prefix-cache-pages", min=1,
                                                  help="The most KV pages the prefix cache indexes (default: the pool)."),
    spec_capture_cache_mb: float | None = typer.Option(None, "--spec-capture-cache-mb", min=0.0,
                                                       help="The drafter's context kept for cached blocks, in MiB "
                                                            "(default: every cached block; 0 = off: warm requests "
                                                            "decode without drafts)."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup",
                                help="Warm up (compile kernels, capture graphs) before /health reports ready."),
    api_key: str | None = typer.Option(None, "--api-key", help="Require Authorization: Bearer <key> on every route "
                                       "but /health (default $SPECBENCH_API_KEY; unset = open)."),
    metrics_auth: bool = typer.Option(False, "--metrics-auth/--no-metrics-auth",
                                      help="With --api-key, require the key on /metrics too (default: open)."),
    allowed_origins: str | None = typer.Option(None, "--allowed-origins",
                                               help="CORS origins: comma-separated or a JSON list, '*' = any "
                                                    "(default: none, no CORS headers)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout",
                                           help="Seconds in-flight requests get to finish after SIGTERM/SIGINT."),
    max_stop_strings: int = typer.Option(64, "--max-stop-strings",
                                         help="The most stop strings one request may send (more: 400 naming stop)."),
    max_stop_length: int = typer.Option(256, "--max-stop-length",
                                        help="The most characters one stop string may have (more: 400 naming stop)."),
    chat_template_timeout: float = typer.Option(5.0, "--chat-template-timeout",
                                                help="Seconds one chat template render may take (it runs in a worker "
                                                     "process; past it the worker is killed and the request gets a "
                                                     "400; at start-up the server is refused)."),
    gil_switch_ms: float | None = typer.Option(None, "--gil-switch-ms", min=0.01, max=100.0,
                                               help="Python's thread switch interval in ms (sys.setswitchinterval): "
                                                    "how long the engine thread may wait for the GIL while the HTTP "
                                                    "side runs (default $SPECBENCH_GIL_SWITCH_MS, else 5, "
                                                    "Python's own)."),
    synthetic_tau: float | None = typer.Option(None, "--synthetic-tau", min=1.0,
                                               help="Draw acceptance with this mean committed length per step "
                                                    "(speed curves on random weights; outputs are not the target's, "
                                                    "/v1/models says so and the lossless and sampled gates refuse "
                                                    "the server)."),
    engine_process: bool | None = typer.Option(None, "--engine-process/--no-engine-process",
                                               help="Run the engine and its step loop in a process of their own, "
                                                    "so they do not share the GIL with the HTTP side (default "
                                                    "$SPECBENCH_ENGINE_PROCESS=0|1, else on; docs/server.md)."),
) -> None:
    """Serve the reference engine with an OpenAI-compatible API (/v1/completions, /v1/chat/completions, ...)."""
    from specbench.engine.config import FRONT_DOOR_METHODS, SPEC_CHOICES, engine_method, spec_method
    from specbench.harness.engines import EngineStringError, bundled
    from specbench.harness.server.lifecycle import BindError, bind
    from specbench.harness.server.options import ServerOptions, parse_origins

    from .serve_checks import EXIT_BIND, EXIT_CONFIG, check_dirs

    if spec is not None and spec not in SPEC_CHOICES:
        typer.echo(f"specbench serve: --spec={spec!r} is invalid: expected {', '.join(FRONT_DOOR_METHODS)} or off",
                   err=True)
        raise typer.Exit(2)
    try:
        opts = ServerOptions.from_env(api_key, metrics_need_key=metrics_auth,
                                      allowed_origins=parse_origins(allowed_origins), shutdown_timeout=shutdown_timeout,
                                      max_stop_strings=max_stop_strings, max_stop_length=max_stop_length,
                                      chat_template_timeout=chat_template_timeout)
    except ValueError as e:
        typer.echo(f"specbench serve: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    try:
        switch = gil_switch_ms if gil_switch_ms is not None else env.get("SPECBENCH_GIL_SWITCH_MS")
    except env.EnvError as e:
        typer.echo(f"specbench serve: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    sys.setswitchinterval(switch / 1000.0)
    try:
        in_child = engine_process_choice(engine_process)
    except ValueError as e:
        typer.echo(f"specbench serve: {e}", err=True)
        raise typer.Exit(EXIT_CONFIG) from None
    bad = check_dirs(model, draft if spec in (None, "dflash") else None) if model is not None else None
    if bad:
        typer.echo(f"specbench serve: {bad}", err=True)
        raise typer.Exit(EXIT_CONFIG)
    try:
        sock = bind(host, port)
    except BindError as e:
        typer.echo(f"specbench serve: {e.strerror}", err=True)
        raise typer.Exit(EXIT_BIND) from None
    port = sock.getsockname()[1]
    if model is None:
        try:
            model, bdraft = bundled()
        except EngineStringError as e:
            typer.echo(f"specbench serve: {e}", err=True)
            raise typer.Exit(2) from None
        draft = draft or (bdraft if spec in (None, "dflash") else None)
    from specbench.engine import ConfigError, EngineConfig, LLMEngine, SpecConfig
    from specbench.engine.config import lever_kw
    from specbench.harness.server import serve as run_server
    from specbench.harness.server.chat import probe_template

    method = spec_method(spec, draft)
    levers = lever_kw(spec_gate, spec_trim, spec_policy)
    prefix_kw: dict[str, Any] = {k_: v for k_, v in (("prefix_cache", prefix_cache), ("prefix_cache_pages",
                                 prefix_cache_pages), ("spec_capture_cache_mb", spec_capture_cache_mb)) if v is not None}
    app = engine = None
    try:
        cfg = EngineConfig(model=model, draft=draft if method == "dflash" else None, device=device, dtype=dtype,
                           max_model_len=max_model_len, num_pages=num_pages,
                           spec=SpecConfig(method=engine_method(method), num_speculative_tokens=k,
                                           synthetic_tau=synthetic_tau, **levers),
                           **prefix_kw)
        if in_child:  # the chat template is probed here before the engine process is spawned
            from specbench.engine.tokenizer import Tokenizer

            tokenizer = Tokenizer(cfg.model)
        else:
            engine = LLMEngine(cfg)
            tokenizer = engine.tokenizer
    except (ConfigError, ValueError, FileNotFoundError) as e:
        typer.echo(f"specbench serve: {e}", err=True)
        raise typer.Exit(2) from None
    unsafe = probe_template(tokenizer, opts.chat_template_timeout)
    if unsafe:
        typer.echo(f"specbench serve: --model={model!r}: {unsafe}", err=True)
        raise typer.Exit(EXIT_CONFIG)
    if in_child:
        from specbench.harness.server import make_proc_app

        # no logging set up here: a refusal below (exit 2) must leave the process's logging as it found it
        # (run_server sets it up once serving starts; the child sets up its own)
        try:
            app, _ = make_proc_app(cfg, served_model_name, max_pending, warmup, opts, log_level)
        except (ConfigError, ValueError, FileNotFoundError) as e:
            typer.echo(f"specbench serve: {e}", err=True)
            raise typer.Exit(2) from None
    if synthetic_tau is not None:
        typer.echo(f"specbench serve: synthetic acceptance tau={synthetic_tau:g}: the number of accepted drafts is "
                   "drawn, so outputs are NOT the target's (speed curves only)", err=True)
    typer.echo(f"specbench serve: {model} (spec={method}) on http://{host}:{port}/v1"
               + (" (engine process)" if in_child else "")
               + ("; warming up, /health answers 200 when ready" if warmup else "; no warm-up"), err=True)
    line = run_server(engine, host=host, port=port, served_name=served_model_name, max_pending=max_pending,
                      log_level=log_level, warmup=warmup, options=opts, sock=sock, app=app)
    if line:
        typer.echo(f"specbench serve: {line}", err=True)
