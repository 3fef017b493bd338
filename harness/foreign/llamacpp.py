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
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PIN = {
    "package": "llama-cpp-python",
    "version": "0.3.36",
    "sdist": "llama_cpp_python-0.3.36.tar.gz",
    "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "llama_cpp_commit": "0c1e570",
    "vendor_dir": "vendor/llama.cpp",
}
SHA12 = PIN["sha256"][:12]
BINARIES = ("llama-server", "llama-quantize")
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",            # gone in this version (LLAMA_OPENSSL replaced it); harmless
    "-DLLAMA_OPENSSL=OFF",         # no HTTPS client needed: models are local files
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would fetch the web UI from a bucket
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",      # llama-server and llama-quantize live under tools/
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF",     # static binaries: the cache directory can be moved (atomic rename)
    "-DGGML_BACKEND_DL=OFF",
    "-DGGML_NATIVE=ON",
)
# Bump when the conversion recipe below changes: it is part of the GGUF cache key.
RECIPE = 1
PERTURB_SEED = 1234
PERTURB_SIGMA = 0.17  # noise std / tensor std: ~35% draft-model acceptance (0.1: 51%, 0.2: 29%, 0.3: 18%)
DFLASH_SAFE_TAPS = [1, 2]  # target layers the runnable DFlash copy taps (the bundled drafter taps [1, 3])

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "fixtures" / "tiny"


class Unavailable(RuntimeError):
    """llama.cpp cannot be provided here (no toolchain, no source, build failed); the message says why."""


# ---------------------------------------------------------------------------------------------- paths


def cache_root() -> Path:
    env = os.environ.get("SPECBENCH_LLAMACPP_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specbench" / "llamacpp"


def build_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / SHA12


def toolchain_missing() -> str | None:
    """None when cmake, a C and a C++ compiler are on PATH; otherwise what is missing."""
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++/g++/clang++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler (cc/gcc/clang)")
    return f"no C++ toolchain: missing {', '.join(missing)}" if missing else None


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{SHA12}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- the source


def fetch_sdist(root: Path | None = None) -> Path:
    """The pinned sdist, downloaded once into <root>/sdist and checked against PIN['sha256']."""
    root = root or cache_root()
    dest = root / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / PIN["sdist"]
    local = os.environ.get("SPECBENCH_LLAMACPP_SDIST")
    if not path.is_file() and local:
        if not Path(local).is_file():
            raise Unavailable(f"SPECBENCH_LLAMACPP_SDIST={local}: no such file")
        shutil.copyfile(local, path.with_suffix(".part"))
        os.replace(path.with_suffix(".part"), path)
    if not path.is_file():
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--disable-pip-version-check", "-d", tmp, f"{PIN['package']}=={PIN['version']}"]
            _log(" ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / PIN["sdist"]
            if r.returncode != 0 or not got.is_file():
                raise Unavailable(f"could not download the {PIN['package']}=={PIN['version']} sdist "
                                  f"(pip exit {r.returncode}): {(r.stderr or r.stdout).strip()[-800:]}")
            os.replace(got, path)
    digest = _sha256(path)
    if digest != PIN["sha256"]:
        bad = path.with_suffix(".bad")
        os.replace(path, bad)
        raise Unavailable(f"{path.name}: sha256 {digest} != pinned {PIN['sha256']} (moved to {bad})")
    return path


def _extract_vendor(sdist: Path, into: Path) -> Path:
    """Extract the sdist into `into` and return its vendored llama.cpp tree."""
    with tarfile.open(sdist) as tf:
        tf.extractall(into, filter="data")
    src = into / PIN["sdist"].removesuffix(".tar.gz") / PIN["vendor_dir"]
    if not (src / "CMakeLists.txt").is_file():
        raise Unavailable(f"{sdist.name} has no {PIN['vendor_dir']}/CMakeLists.txt")
    return src


# ------------------------------------------------------------------------------------------ the build


@dataclass(frozen=True)
class Build:
    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def server(self) -> Path:
        return self.bin / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.bin / "llama-quantize"

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def info(self) -> dict:
        return json.loads((self.root / "build.json").read_text())

    def complete(self) -> bool:
        return (self.root / "build.json").is_file() and all((self.bin / b).is_file() for b in BINARIES)


def cached_build(root: Path | None = None) -> Build | None:
    b = Build(build_dir(root))
    return b if b.complete() else None


def _run_logged(cmd: Sequence[str], cwd: Path, log, env: dict | None = None) -> float:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    t0 = time.monotonic()
    r = subprocess.run(list(cmd), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
    dt = time.monotonic() - t0
    log.write(f"# exit {r.returncode} after {dt:.1f} s\n")
    log.flush()
    if r.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd[:3])} ...` failed (exit {r.returncode}); see {log.name}")
    return dt


def _version_line(server: Path) -> str:
    try:
        r = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    return " ".join((r.stdout + r.stderr).split())[:300]


def install_build(tmp: Path, src: Path, build_subdir: Path, timings: dict, jobs: int) -> Path:
    """Copy the binaries and the source tree into `tmp` (the future <sha12>/), write build.json, rename."""
    (tmp / "bin").mkdir(parents=True, exist_ok=True)
    for b in BINARIES:
        shutil.copy2(build_subdir / "bin" / b, tmp / "bin" / b)
    if src.resolve() != (tmp / "src").resolve():
        shutil.rmtree(build_subdir, ignore_errors=True)  # object files: hundreds of MB, not needed
        shutil.move(str(src), tmp / "src")
    cxx = shutil.which("c++") or shutil.which("g++") or "?"
    cxx_ver = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    info = {
        "pin": PIN,
        "cmake_args": list(CMAKE_ARGS),
        "targets": list(BINARIES),
        "jobs": jobs,
        "cxx": cxx_ver,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "version": _version_line(tmp / "bin" / "llama-server"),
        **timings,
    }
    (tmp / "build.json").write_text(json.dumps(info, indent=2) + "\n")
    for junk in tmp.iterdir():  # the rest of the extracted sdist
        if junk.name not in ("bin", "src", "build.json", "build.log"):
            shutil.rmtree(junk) if junk.is_dir() else junk.unlink()
    final = tmp.parent / SHA12
    os.rename(tmp, final)
    return final


def ensure_build(root: Path | None = None, jobs: int | None = None) -> Build:
    """The cached build, or fetch + build it now (10+ minutes on two cores). Raises Unavailable."""
    root = root or cache_root()
    b = cached_build(root)
    if b:
        return b
    why = toolchain_missing()
    if why:
        raise Unavailable(why)
    jobs = jobs or int(os.environ.get("SPECBENCH_LLAMACPP_JOBS", "0")) or min(2, os.cpu_count() or 1)
    with _locked(root):
        b = cached_build(root)
        if b:  # another process finished it while we waited for the lock
            return b
        for stale in root.glob(f".tmp-{SHA12}-*"):  # only the lock holder builds: the rest are dead
            shutil.rmtree(stale, ignore_errors=True)
        if build_dir(root).exists():  # incomplete (no build.json): not ours to trust
            shutil.rmtree(build_dir(root))
        sdist = fetch_sdist(root)
        tmp = root / f".tmp-{SHA12}-{os.getpid()}"
        tmp.mkdir(parents=True)
        log_path = tmp / "build.log"
        _log(f"building llama.cpp {PIN['llama_cpp_commit']} into {build_dir(root)} (log {log_path})")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            src = _extract_vendor(sdist, tmp / "extract")
            cfg_s = _run_logged(["cmake", "-B", "build", *CMAKE_ARGS], src, log)
            bld_s = _run_logged(["cmake", "--build", "build", f"-j{jobs}", "--target", *BINARIES], src, log)
        timings = {"configure_s": round(cfg_s, 1), "build_s": round(bld_s, 1),
                   "total_s": round(time.monotonic() - t0, 1)}
        install_build(tmp, src, src / "build", timings, jobs)
        _log(f"built in {timings['total_s']} s")
    b = cached_build(root)
    if b is None:
        raise Unavailable(f"build finished but {build_dir(root)} is incomplete")
    return b


# ----------------------------------------------------------------------------------------- the models


def dir_hash(*dirs: Path) -> str:
    """sha256 over (relative path, bytes) of every file under the given directories, in sorted order."""
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(q for q in Path(d).rglob("*") if q.is_file()):
            h.update(f"{d.name}/{p.relative_to(d)}\0".encode())
            h.update(_sha256(p).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Models:
    """Paths of the converted fixture GGUFs (all share the tiny target's tokenizer)."""

    dir: Path
    target_f32: Path
    target_q8_0: Path
    target_q4_0: Path
    perturbed: Path        # the target with seeded weight noise: the draft-model drafter / a wrong model
    dflash: Path           # the bundled DFlash drafter re-tapped to DFLASH_SAFE_TAPS: llama.cpp runs it
    dflash_lasttap: Path   # the bundled drafter as is (taps the last target layer): llama.cpp aborts
    info: dict = field(default_factory=dict, compare=False)


def perturbed_target(target_dir: Path, out_dir: Path, sigma: float = PERTURB_SIGMA,
                     seed: int = PERTURB_SEED) -> Path:
    """A copy of the HF target with w + sigma * std(w) * N(0, 1) on every tensor (seeded, in sorted name
    order), every other file copied: same tokenizer, a related but different model."""
    import torch
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    for p in target_dir.iterdir():
        if p.is_file() and p.name != "model.safetensors":
            shutil.copy2(p, out_dir / p.name)
    tensors = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    noisy = {}
    for name in sorted(tensors):
        w = tensors[name].float()
        scale = w.std() if w.numel() > 1 else w.abs()
        noise = torch.randn(w.shape, generator=g, dtype=torch.float32)
        noisy[name] = (w + sigma * scale * noise).to(tensors[name].dtype).contiguous()
    save_file(noisy, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def retapped_drafter(draft_dir: Path, out_dir: Path, taps: list[int]) -> Path:
    """A copy of the DFlash drafter whose `dflash_config.target_layer_ids` is `taps` (weights unchanged:
    the context projection then sees other layers' features than it was trained on; lower acceptance)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for p in draft_dir.iterdir():
        if p.is_file() and p.name != "config.json":
            shutil.copy2(p, out_dir / p.name)
    cfg = json.loads((draft_dir / "config.json").read_text())
    if len(taps) != len(cfg["dflash_config"]["target_layer_ids"]):
        raise ValueError(f"taps {taps}: the drafter's fc expects {len(cfg['dflash_config']['target_layer_ids'])}")
    cfg["dflash_config"]["target_layer_ids"] = list(taps)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out_dir


def convert(build: Build, model_dir: Path, out: Path, log, target_model_dir: Path | None = None,
            outtype: str = "f32") -> Path:
    """HF dir -> GGUF with the vendored converter through the patching wrapper (`_convert`)."""
    cmd = [sys.executable, "-m", "specbench.harness.foreign._convert", "--llama-src", str(build.src),
           "--force-pre", "qwen2", "--", str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    if target_model_dir is not None:
        cmd += ["--target-model-dir", str(target_model_dir)]
    env = dict(os.environ, NO_LOCAL_GGUF="1")  # gguf-py is put on sys.path by the wrapper itself
    # The wrapper module is imported from wherever specbench is; make that importable in the child.
    pkg_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), pkg_parent) if p)
    _run_logged(cmd, out.parent, log, env=env)
    return out


def quantize(build: Build, src: Path, out: Path, qtype: str, log) -> Path:
    _run_logged([str(build.quantize), str(src), str(out), qtype, "1"], out.parent, log)
    return out


def ensure_models(build: Build, target_dir: Path | None = None, draft_dir: Path | None = None) -> Models:
    """Convert the fixtures once, cached under <build>/gguf/<hash12 of fixtures + recipe>/."""
    target_dir = Path(target_dir or BUNDLED / "target")
    draft_dir = Path(draft_dir or BUNDLED / "draft")
    key = hashlib.sha256(f"{dir_hash(target_dir, draft_dir)} recipe={RECIPE} sigma={PERTURB_SIGMA} "
                         f"seed={PERTURB_SEED} taps={DFLASH_SAFE_TAPS}".encode()).hexdigest()[:12]
    out = build.root / "gguf" / key
    names = {"target_f32": "target-f32.gguf", "target_q8_0": "target-q8_0.gguf",
             "target_q4_0": "target-q4_0.gguf", "perturbed": "perturbed-f32.gguf",
             "dflash": "dflash-taps12-f32.gguf", "dflash_lasttap": "dflash-lasttap-f32.gguf"}

    def models() -> Models:
        return Models(dir=out, info=json.loads((out / "models.json").read_text()),
                      **{k: out / v for k, v in names.items()})

    if (out / "models.json").is_file():
        return models()
    with _locked(build.root.parent):
        if (out / "models.json").is_file():
            return models()
        tmp = out.parent / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        t0 = time.monotonic()
        with open(tmp / "convert.log", "w") as log, tempfile.TemporaryDirectory() as hf:
            hf = Path(hf)
            convert(build, target_dir, tmp / names["target_f32"], log)
            quantize(build, tmp / names["target_f32"], tmp / names["target_q8_0"], "Q8_0", log)
            quantize(build, tmp / names["target_f32"], tmp / names["target_q4_0"], "Q4_0", log)
            convert(build, perturbed_target(target_dir, hf / "perturbed"), tmp / names["perturbed"], log)
            convert(build, retapped_drafter(draft_dir, hf / "dflash", DFLASH_SAFE_TAPS),
                    tmp / names["dflash"], log, target_model_dir=target_dir)
            convert(build, draft_dir, tmp / names["dflash_lasttap"], log, target_model_dir=target_dir)
        info = {"target_dir": str(target_dir), "draft_dir": str(draft_dir), "recipe": RECIPE,
                "perturb": {"sigma": PERTURB_SIGMA, "seed": PERTURB_SEED},
                "dflash_taps": {"dflash": DFLASH_SAFE_TAPS,
                                "dflash_lasttap": json.loads((draft_dir / "config.json").read_text())
                                ["dflash_config"]["target_layer_ids"]},
                "convert_s": round(time.monotonic() - t0, 1),
                "sha256": {k: _sha256(tmp / v) for k, v in names.items()}}
        (tmp / "models.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    return models()


# ---------------------------------------------------------------------------------------- the servers

# The speculation arguments per kind, as the vendored llama-server spells them (its --help: the old
# `--draft-max/--draft-min` are removed and refuse to start; `--spec-draft-n-max/-n-min` replace them;
# n-gram sizes are per type). DFlash drafts at most block_size - 1 = 7 (it clamps larger values).
DRAFT_N = ["--spec-draft-n-max", "8", "--spec-draft-n-min", "0"]
KINDS = {
    "off": {"model": "target_f32", "spec": []},
    "draft": {"model": "target_f32", "draft": "perturbed", "spec": ["--spec-type", "draft-simple", *DRAFT_N]},
    "ngram": {"model": "target_f32",
              "spec": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                       "--spec-ngram-simple-size-m", "8"]},
    "dflash": {"model": "target_f32", "draft": "dflash",
               "spec": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]},
    "dflash-lasttap": {"model": "target_f32", "draft": "dflash_lasttap",
                       "spec": ["--spec-type", "draft-dflash", "--spec-draft-n-max", "7"]},
    # Deliberately broken pairing for the gates: a different model behind a "spec off" server.
    "wrong": {"model": "perturbed", "spec": []},
    "q8_0": {"model": "target_q8_0", "spec": []},
    "q4_0": {"model": "target_q4_0", "spec": []},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig() -> None:  # runs in the child before exec: die with the parent (Linux only)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def http_post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict | str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode("utf-8", "replace"), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class _PortTaken(Exception):
    pass


class LlamaServer:
    """One `llama-server` process on a free loopback port. Use as a context manager or call start()/stop().

    `.base_url` (http://127.0.0.1:PORT, no /v1), `.log_path` (stdout+stderr of the server), `.args`
    (the full command line), `.returncode` once stopped or dead, `.alive()`.
    """

    def __init__(self, build: Build, model: Path, draft: Path | None = None, spec: Sequence[str] = (),
                 *, ctx: int | None = None, parallel: int = 4, threads: int = 2, lifetime_s: float = 1800.0,
                 health_timeout_s: float = 120.0, log_dir: Path | None = None, name: str = "server",
                 alias: str | None = None, extra: Sequence[str] = ()):
        self.build, self.model, self.draft = build, Path(model), Path(draft) if draft else None
        self.name, self.lifetime_s, self.health_timeout_s = name, lifetime_s, health_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="specbench-llamacpp-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{name}-{self.port}.log"
        ctx = ctx or 2048 * parallel  # split evenly over the slots: the tiny model's 2048 positions each
        self.args = [str(build.server), "-m", str(self.model), "--host", "127.0.0.1",
                     "--port", str(self.port), "-c", str(ctx), "-np", str(parallel), "-t", str(threads),
                     "-tb", str(threads), "--metrics", "--no-webui", "--poll", "0",
                     "--alias", alias or name]
        if self.draft is not None:
            self.args += ["-md", str(self.draft), "-td", str(threads), "-tbd", str(threads)]
        self.args += [*spec, *extra]
        self.proc: subprocess.Popen | None = None
        self._timer: threading.Timer | None = None
        self._log_fh = None
        self.returncode: int | None = None
        self.started_s: float | None = None

    # lifecycle -------------------------------------------------------------------------------------
    def _set_port(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.args[self.args.index("--port") + 1] = str(port)

    def start(self, attempts: int = 3) -> LlamaServer:
        """Spawn and wait for /health; a port lost to another process between `free_port()` and the
        server's bind is retried on a fresh port. Starting twice is refused."""
        if self.proc is not None:
            raise RuntimeError(f"{self!r} was already started")
        for attempt in range(attempts):
            try:
                return self._spawn()
            except _PortTaken:
                if attempt == attempts - 1:
                    raise Unavailable(f"llama-server ({self.name}): no free port after {attempts} tries; "
                                      f"log {self.log_path}:\n{self.log_tail()}") from None
                self.proc = None
                self._set_port(free_port())
        raise AssertionError("unreachable")

    def _spawn(self) -> LlamaServer:
        cmd = list(self.args)
        if shutil.which("timeout"):  # the hard bound survives this Python process dying
            cmd = [shutil.which("timeout"), "-k", "10", f"{int(self.lifetime_s)}", *cmd]
        env = dict(os.environ, OMP_WAIT_POLICY="passive")  # no idle spinning on shared cores
        self.log_path = self.log_path.with_name(f"llama-server-{self.name}-{self.port}.log")
        self._log_fh = open(self.log_path, "w")
        self._log_fh.write(f"$ {' '.join(self.args)}\n")
        self._log_fh.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log_fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                     preexec_fn=_pdeathsig)
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            if "couldn't bind HTTP server socket" in self.log_tail(200):
                raise _PortTaken() from None
            raise
        self.started_s = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise Unavailable(f"llama-server ({self.name}) exited with {self.proc.returncode} before "
                                  f"becoming healthy; log {self.log_path}:\n{self.log_tail()}")
            try:
                status, body = http_get(self.base_url + "/health", timeout=2.0)
                if status == 200:
                    # Someone else may own the port (our bind then fails within milliseconds): it is ours
                    # only if our process is still running a moment later and says it listens there.
                    mine = f"listening on http://127.0.0.1:{self.port}" in self.log_tail(400)
                    if mine and self.proc is not None and self.proc.poll() is None:
                        return
                    last = "HTTP 200 from a process that has not logged `listening on` this port"
                last = f"HTTP {status} {body[:200]}"
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        raise Unavailable(f"llama-server ({self.name}) not healthy after {self.health_timeout_s} s "
                          f"(last: {last}); log {self.log_path}:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after `grace_s`; idempotent; returns the exit code."""
        if self._timer is not None:
            self._timer.cancel()
        p = self.proc
        if p is not None and p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if p is not None:
            self.returncode = p.poll()
        if self._log_fh is not None and not self._log_fh.closed:
            self._log_fh.close()
        return self.returncode

    def __enter__(self) -> LlamaServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # helpers ---------------------------------------------------------------------------------------
    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        return http_get(self.base_url + path, timeout=timeout)

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | str]:
        return http_post(self.base_url + path, body, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Prometheus text from /metrics as {name{labels}: value} (comments dropped)."""
        status, text = self.get("/metrics")
        if status != 200:
            raise Unavailable(f"/metrics: HTTP {status} {text[:200]}")
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = float(v)
        return out

    def __repr__(self) -> str:
        return f"LlamaServer({self.name}, {self.base_url}, alive={self.alive()})"


def start_server(kind: str, models: Models, build: Build, **kw) -> LlamaServer:
    """Start the server of one of KINDS (see there) and wait until /health is ok."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    k = KINDS[kind]
    draft = getattr(models, k["draft"]) if "draft" in k else None
    kw.setdefault("name", kind)
    return LlamaServer(build, getattr(models, k["model"]), draft, k["spec"], **kw).start()


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
