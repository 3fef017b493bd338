"""Provenance for run records: git state, package versions, device, host, command line.

Contract: `provenance()` never raises and never takes long: every probe that fails (no git, no CUDA)
yields None for its field. The git probe looks at the repository this package is installed from (an
editable checkout); a wheel install has no git state and says so.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from .redact import redact_argv

PACKAGES = ("specbench", "torch", "transformers", "tokenizers", "numpy", "httpx", "fastapi", "uvicorn", "pandas",
            "openai", "lm_eval", "flashinfer-python", "triton", "vllm", "sglang")
REPO = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_state() -> dict:
    sha = _git("rev-parse", "HEAD")
    if sha is None:
        return {"sha": None, "dirty": None}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def device_info() -> dict:
    """CPU, and GPUs through torch when the process already uses it, else through nvidia-smi."""
    info: dict = {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    torch = sys.modules.get("torch")  # importing torch only to describe the machine costs seconds
    try:
        if torch is not None:
            info["torch_threads"] = torch.get_num_threads()
            if torch.cuda.is_available():
                info["cuda"] = torch.version.cuda
                info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                return info
        if shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=5)
            if r.returncode == 0:
                info["gpus"] = [line.split(",")[0].strip() for line in r.stdout.splitlines() if line.strip()]
    except Exception:  # a broken CUDA install must not stop a run from recording itself
        pass
    return info


def provenance() -> dict:
    return {"git": git_state(), "packages": package_versions(), "device": device_info(),
            "python": sys.version.split()[0], "platform": platform.platform(), "host": socket.gethostname(),
            "pid": os.getpid(), "argv": redact_argv(sys.argv), "time": time.time()}
