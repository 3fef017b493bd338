"""The llama.cpp source: the pinned `llama-cpp-python` sdist, fetched once, checked and unpacked.

The sdist (`PIN`) vendors llama.cpp under vendor/llama.cpp. `fetch_sdist` downloads it with
`pip download --no-deps --no-binary :all:` (or copies SPECBENCH_LLAMACPP_SDIST) into <root>/sdist, where
<root> is `cache_root()` (SPECBENCH_LLAMACPP_CACHE, else `~/.cache/specbench/llamacpp`), and refuses it
unless its sha256 is the pinned one; `_extract_vendor` unpacks it and returns the vendored tree.
`Unavailable` is the one error of the whole llama.cpp harness (build.py, gguf.py, server.py raise it too).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specbench import env

PIN = {
    "package": "llama-cpp-python",
    "version": "0.3.36",
    "sdist": "llama_cpp_python-0.3.36.tar.gz",
    "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    "llama_cpp_commit": "0c1e570",
    "vendor_dir": "vendor/llama.cpp",
}
SHA12 = PIN["sha256"][:12]  # as imported; the code calls sha12(), which follows a patched PIN


def sha12() -> str:
    """`PIN`'s sha256, first 12 hex digits: the build's cache key (`SHA12`), read from `PIN` at each call."""
    return PIN["sha256"][:12]


class Unavailable(RuntimeError):
    """llama.cpp cannot be provided here (no toolchain, no source, build failed); the message says why."""


def cache_root() -> Path:
    return Path(env.get("SPECBENCH_LLAMACPP_CACHE")).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", file=sys.stderr, flush=True)


def fetch_sdist(root: Path | None = None) -> Path:
    """The pinned sdist, downloaded once into <root>/sdist and checked against PIN['sha256']."""
    root = root or cache_root()
    dest = root / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / PIN["sdist"]
    local = env.get("SPECBENCH_LLAMACPP_SDIST")
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
