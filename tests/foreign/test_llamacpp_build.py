"""The build cache logic of specbench.harness.foreign.llamacpp, with a fake sdist and a fake cmake (no
compiler runs): sha256 pin, atomic install, reuse, one builder at a time, failures, no toolchain."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from pathlib import Path

import pytest

from specbench.harness.foreign import llamacpp as lc

FAKE_CMAKE = r"""#!/bin/bash
echo "$*" >> "$FAKE_CMAKE_CALLS"
if [ "$1" = "-B" ]; then mkdir -p "$2"; exit 0; fi
if [ "$1" = "--build" ]; then
  [ -n "$FAKE_CMAKE_FAIL" ] && { echo "error: fake failure"; exit 1; }
  sleep "${FAKE_CMAKE_SLEEP:-0}"
  mkdir -p "$2/bin"
  for b in llama-server llama-quantize; do
    printf '#!/bin/sh\necho "version: fake (commit 0c1e570)"\n' > "$2/bin/$b"; chmod +x "$2/bin/$b"
  done
  exit 0
fi
exit 2
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake sdist pinned by its own sha256, a fake cmake first on PATH, a private cache root."""
    buf = io.BytesIO()
    top = lc.PIN["sdist"].removesuffix(".tar.gz")
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in ((f"{top}/{lc.PIN['vendor_dir']}/CMakeLists.txt", b"project(fake)\n"),
                           (f"{top}/{lc.PIN['vendor_dir']}/convert_hf_to_gguf.py", b"# fake\n"),
                           (f"{top}/pyproject.toml", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    sdist = tmp_path / lc.PIN["sdist"]
    sdist.write_bytes(buf.getvalue())
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    monkeypatch.setitem(lc.PIN, "sha256", digest)
    monkeypatch.setattr(lc, "SHA12", digest[:12])
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "cmake").write_text(FAKE_CMAKE)
    (bindir / "cmake").chmod(0o755)
    calls = tmp_path / "cmake-calls"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CMAKE_CALLS", str(calls))
    monkeypatch.setenv("SPECBENCH_LLAMACPP_SDIST", str(sdist))
    monkeypatch.setenv("SPECBENCH_LLAMACPP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FAKE_CMAKE_FAIL", raising=False)
    return {"root": tmp_path / "cache", "calls": calls, "sdist": sdist, "bindir": bindir}


def _calls(fake) -> list[str]:
    return fake["calls"].read_text().splitlines() if fake["calls"].exists() else []


def test_build_installs_atomically_and_is_reused(fake):
    b = lc.ensure_build()
    assert b.root == fake["root"] / lc.SHA12 and b.complete()
    info = json.loads((b.root / "build.json").read_text())
    assert info["cmake_args"] == list(lc.CMAKE_ARGS) and info["pin"]["sha256"] == lc.PIN["sha256"]
    assert {"configure_s", "build_s", "total_s", "version"} <= info.keys() and "fake" in info["version"]
    assert (b.src / "convert_hf_to_gguf.py").is_file() and (b.root / "build.log").is_file()
    assert not (b.src / "build").exists(), "object files are dropped after install"
    assert sorted(p.name for p in b.root.iterdir()) == ["bin", "build.json", "build.log", "src"]
    assert not list(fake["root"].glob(".tmp-*"))
    assert _calls(fake)[0] == " ".join(["-B", "build", *lc.CMAKE_ARGS])
    assert _calls(fake)[1].split()[-3:] == ["--target", "llama-server", "llama-quantize"]
    n = len(_calls(fake))
    assert lc.ensure_build().root == b.root and len(_calls(fake)) == n, "a cached build runs no cmake"


def test_a_build_made_with_other_cmake_args_is_rebuilt(fake):
    """A cached build from an older flag set (e.g. one with ggml's AMX matmul) is not trusted: rebuilt once."""
    b = lc.ensure_build()
    info = json.loads((b.root / "build.json").read_text())
    (b.root / "build.json").write_text(json.dumps({**info, "cmake_args": info["cmake_args"][:-1]}))
    assert not b.complete() and lc.cached_build() is None
    n = sum(c.startswith("--build") for c in _calls(fake))
    assert lc.ensure_build().complete() and sum(c.startswith("--build") for c in _calls(fake)) == n + 1


def test_no_amx_on_x86(monkeypatch):
    """ggml's AMX matmul (on with -march=native on an AMX CPU) segfaults at this pin on the quantized fixtures."""
    import platform

    from specbench.harness.foreign import build
    if platform.machine().lower() in ("x86_64", "amd64"):
        for lang in ("C", "CXX"):
            flag = next(a for a in build.CMAKE_ARGS if a.startswith(f"-DCMAKE_{lang}_FLAGS="))
            assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(flag.split("=", 1)[1].split())
    assert "-DGGML_NATIVE=ON" in build.CMAKE_ARGS


def test_one_builder_at_a_time(fake, monkeypatch):
    monkeypatch.setenv("FAKE_CMAKE_SLEEP", "1")
    out: list = []
    ts = [threading.Thread(target=lambda: out.append(lc.ensure_build())) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 3 and len({o.root for o in out}) == 1
    assert sum(c.startswith("--build") for c in _calls(fake)) == 1


def test_stale_temp_dir_is_cleaned(fake):
    stale = fake["root"] / f".tmp-{lc.SHA12}-999999"
    (stale / "junk").mkdir(parents=True)
    lc.ensure_build()
    assert not stale.exists()


def test_sha256_mismatch_is_refused(fake):
    fake["sdist"].write_bytes(fake["sdist"].read_bytes() + b"x")
    with pytest.raises(lc.Unavailable, match="sha256"):
        lc.ensure_build()
    assert lc.cached_build() is None


def test_failed_build_leaves_no_build(fake, monkeypatch):
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    with pytest.raises(lc.Unavailable, match="build.log"):
        lc.ensure_build()
    assert lc.cached_build() is None and not (fake["root"] / lc.SHA12).exists()
    logs = list(fake["root"].glob(f".tmp-{lc.SHA12}-*/build.log"))
    assert logs and "fake failure" in logs[0].read_text()


def test_no_toolchain(fake, monkeypatch, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert "cmake" in (lc.toolchain_missing() or "")
    with pytest.raises(lc.Unavailable, match="no C\\+\\+ toolchain"):
        lc.ensure_build()


def test_retapped_and_perturbed_copies(tmp_path):
    draft = lc.retapped_drafter(lc.BUNDLED / "draft", tmp_path / "d", [1, 2])
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    assert (draft / "model.safetensors").read_bytes() == (lc.BUNDLED / "draft" / "model.safetensors").read_bytes()
    a = lc.perturbed_target(lc.BUNDLED / "target", tmp_path / "a")
    b = lc.perturbed_target(lc.BUNDLED / "target", tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes(), "seeded"
    assert (a / "model.safetensors").read_bytes() != (lc.BUNDLED / "target" / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (lc.BUNDLED / "target" / "tokenizer.json").read_bytes()


def test_dir_hash_sees_content(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "f").write_text("1")
    h1 = lc.dir_hash(d)
    (d / "f").write_text("2")
    assert lc.dir_hash(d) != h1


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECBENCH_LLAMACPP_CACHE", raising=False)
    assert lc.cache_root() == Path.home() / ".cache" / "specbench" / "llamacpp"
    monkeypatch.setenv("SPECBENCH_LLAMACPP_CACHE", str(tmp_path))
    assert lc.build_dir() == tmp_path / lc.SHA12
