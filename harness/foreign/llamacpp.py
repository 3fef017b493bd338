"""llama.cpp's `llama-server` as a foreign engine: fetched, built, fed GGUF fixtures and started here.

    python -m specbench.harness.foreign.llamacpp build     # fetch + verify + build (cached), print paths
    python -m specbench.harness.foreign.llamacpp convert   # GGUF fixtures (cached), print paths
    python -m specbench.harness.foreign.llamacpp serve KIND [--seconds N]   # one server, prints its URL
    python -m specbench.harness.foreign.llamacpp env       # toolchain, pin, cache state as JSON

Source: the `llama-cpp-python` sdist from PyPI (`PIN`), which vendors llama.cpp under
vendor/llama.cpp. It is fetched with `pip download --no-deps --no-binary :all:` (or taken from
SPECBENCH_LLAMACPP_SDIST), its sha256 checked against the pin, extracted and built once.

Cache (outside the clone; SPECBENCH_LLAMACPP_CACHE overrides `~/.cache/specbench/llamacpp`):

    <root>/sdist/<sdist file>
    <root>/<sha12>/bin/{llama-server,llama-quantize}   static binaries
    <root>/<sha12>/src/                                 the vendored llama.cpp tree (converter, gguf-py)
    <root>/<sha12>/build.json, build.log                cmake args, times, compiler, `--version`
    <root>/<sha12>/gguf/<fixture12>/*.gguf, models.json  the converted fixtures (see `ensure_models`)
    <root>/<sha12>.lock                                 flock: one builder / converter at a time

A build happens in `<root>/.tmp-<sha12>-<pid>/` and is renamed into place when complete, so a
directory `<sha12>/` with build.json is always a finished build.

Servers: `start_server(kind, models)` / `LlamaServer(...)` run `llama-server` on a free loopback port
with `--metrics`, wait for `/health`, keep stderr in a log file, are killed after a bounded lifetime
(`timeout -k` around the process plus a timer here, plus PR_SET_PDEATHSIG) and stop with SIGTERM,
then SIGKILL. Kinds: see `KINDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

# The facade: the public names live in source.py (pin, fetch, verify), build.py (cmake, cache, lock),
# gguf.py (conversion, drafters) and server.py (LlamaServer, start_server); this module re-exports them
# and is the CLI.
from .build import (
    BINARIES,
    CMAKE_ARGS,
    Build,
    build_dir,
    cached_build,
    ensure_build,
    install_build,
    toolchain_missing,
)
from .gguf import (
    BUNDLED,
    DFLASH_SAFE_TAPS,
    PERTURB_SEED,
    PERTURB_SIGMA,
    RECIPE,
    Models,
    convert,
    dir_hash,
    ensure_models,
    perturbed_target,
    quantize,
    retapped_drafter,
)
from .server import DRAFT_N, KINDS, LlamaServer, free_port, http_get, http_post, start_server
from .source import PIN, SHA12, Unavailable, cache_root, fetch_sdist, sha12

__all__ = [
    "BINARIES", "BUNDLED", "CMAKE_ARGS", "DFLASH_SAFE_TAPS", "DRAFT_N", "KINDS", "PERTURB_SEED", "PERTURB_SIGMA",
    "PIN", "RECIPE", "SHA12", "Build", "LlamaServer", "Models", "Unavailable", "build_dir", "cache_root",
    "cached_build", "convert", "dir_hash", "ensure_build", "ensure_models", "fetch_sdist", "free_port",
    "http_get", "http_post", "install_build", "main", "perturbed_target", "quantize", "retapped_drafter",
    "sha12", "start_server", "toolchain_missing",
]

# ------------------------------------------------------------------------------------------------ CLI


def _env() -> dict:
    b = cached_build()
    return {"pin": PIN, "cache_root": str(cache_root()), "build_dir": str(build_dir()),
            "toolchain": toolchain_missing() or "ok", "cached": b is not None,
            "build": b.info if b else None, "python": sys.executable}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.harness.foreign.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("build", help="fetch, verify and build llama-server + llama-quantize (cached)")
    p.add_argument("-j", "--jobs", type=int, default=None)
    sub.add_parser("convert", help="build if needed, then convert the tiny fixtures to GGUF (cached)")
    p = sub.add_parser("serve", help="start one server and keep it until Ctrl-C or --seconds")
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--threads", type=int, default=2)
    sub.add_parser("env", help="toolchain, pin and cache state as JSON")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "env":
            print(json.dumps(_env(), indent=2))
            return 0
        b = ensure_build(jobs=getattr(args, "jobs", None))
        if args.cmd == "build":
            print(json.dumps({"dir": str(b.root), "server": str(b.server), "quantize": str(b.quantize),
                              **{k: b.info.get(k) for k in ("version", "configure_s", "build_s", "total_s")}},
                             indent=2))
            return 0
        m = ensure_models(b)
        if args.cmd == "convert":
            print(json.dumps({k: str(v) for k, v in vars(m).items() if k != "info"} | {"info": m.info},
                             indent=2))
            return 0
        with start_server(args.kind, m, b, lifetime_s=args.seconds + 15, threads=args.threads) as s:
            print(json.dumps({"kind": args.kind, "base_url": s.base_url, "log": str(s.log_path),
                              "args": s.args}), flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                end = time.monotonic() + args.seconds
                while s.alive() and time.monotonic() < end:
                    time.sleep(0.5)
        return 0
    except Unavailable as e:
        print(f"llama.cpp unavailable: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
