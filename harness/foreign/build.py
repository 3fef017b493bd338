"""The llama.cpp build: cmake once per pin into a cache directory, one builder at a time.

    <root>/<sha12>/bin/{llama-server,llama-quantize}   static binaries
    <root>/<sha12>/src/                                 the vendored llama.cpp tree (converter, gguf-py)
    <root>/<sha12>/build.json, build.log                cmake args, times, compiler, `--version`
    <root>/<sha12>.lock                                 flock: one builder / converter at a time

A build happens in `<root>/.tmp-<sha12>-<pid>/` and is renamed into place when complete, so a
directory `<sha12>/` with build.json is always a finished build (`Build.complete`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from specbench import env

from .source import PIN, Unavailable, _extract_vendor, _log, cache_root, fetch_sdist, sha12

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
# No AMX on x86: -march=native turns on ggml's AMX matmul on a CPU with AMX (Sapphire Rapids and later), and at
# this pin it segfaults in ggml_backend_amx_mul_mat when llama-server loads the Q8_0 or Q4_0 fixture target
# (signal 11 on every start, seen on a Xeon with amx_int8/amx_tile, 2026-12-02; the f32 target is unaffected).
# GCC and clang let an explicit -mno-* win over -march=native whatever the order, so the rest stays native.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if platform.machine().lower() in ("x86_64", "amd64"):
    CMAKE_ARGS += (f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}")


def build_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / sha12()


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
    with open(root / f"{sha12()}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
        """Built with today's CMAKE_ARGS: a build made with other flags (an older specbench) is rebuilt."""
        if not ((self.root / "build.json").is_file() and all((self.bin / b).is_file() for b in BINARIES)):
            return False
        try:
            return self.info.get("cmake_args") == list(CMAKE_ARGS)
        except (OSError, ValueError):
            return False


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
    final = tmp.parent / sha12()
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
    jobs = jobs or env.get("SPECBENCH_LLAMACPP_JOBS") or min(2, os.cpu_count() or 1)
    with _locked(root):
        b = cached_build(root)
        if b:  # another process finished it while we waited for the lock
            return b
        for stale in root.glob(f".tmp-{sha12()}-*"):  # only the lock holder builds: the rest are dead
            shutil.rmtree(stale, ignore_errors=True)
        if build_dir(root).exists():  # incomplete (no build.json) or other flags: not ours to trust
            shutil.rmtree(build_dir(root))
        sdist = fetch_sdist(root)
        tmp = root / f".tmp-{sha12()}-{os.getpid()}"
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

