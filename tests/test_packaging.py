"""The install stays quiet and complete: every folder setuptools would treat as a package is listed in
pyproject's `packages` (an unlisted one is installed "as data" with a warning per folder, and a listed one
that does not exist fails the build), the license is an SPDX string with its file, every third-party
module our code imports is declared (core or an extra), and the constraints file pins every declared
requirement."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CODE = ("engine", "kernels", "harness", "suites", "cli", "benchmarks", "specbench")
# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml", "lm_eval": "lm-eval", "flashinfer": "flashinfer-python", "import_linter": "import-linter"}
# imports that are not distributions: harness/foreign/_convert.py imports llama.cpp's vendored `conversion`
# package from the built source tree (docs/foreign.md)
NOT_DISTS = {"conversion"}


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> dict[str, set[str]]:
    """distribution -> the groups that declare it ("core" or an extra's name)."""
    proj = PYPROJECT["project"]
    out: dict[str, set[str]] = {}
    for req in proj["dependencies"]:
        out.setdefault(_requirement_name(req), set()).add("core")
    for extra, reqs in proj["optional-dependencies"].items():
        for req in reqs:
            out.setdefault(_requirement_name(req), set()).add(extra)
    return out


def _package_dirs() -> dict[str, Path]:
    """Every folder setuptools maps to a package name, by walking the package-dir roots."""
    tool = PYPROJECT["tool"]["setuptools"]
    out: dict[str, Path] = {}
    for name, rel in tool["package-dir"].items():
        root = ROOT / rel
        for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            parts = d.relative_to(root).parts
            if "__pycache__" in parts or any(not part.isidentifier() for part in parts):
                continue  # tiny-dflash2/ and the like are not package names: plain data under package-data
            if not any(f.is_file() and "__pycache__" not in f.parts for f in d.rglob("*")):
                continue  # an empty folder is nothing to setuptools
            out[".".join((name, *parts))] = d
    return out


def test_every_package_folder_is_listed() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = _package_dirs()
    unlisted = sorted(n for n in found if n not in listed)
    assert not unlisted, f"pyproject [tool.setuptools] packages is missing {unlisted} (setuptools warns per folder)"
    missing = sorted(n for n in listed if n not in found)
    assert not missing, f"pyproject lists packages with no folder: {missing}"


def test_license_is_an_spdx_string_with_its_file() -> None:
    proj = PYPROJECT["project"]
    assert proj["license"] == "MIT", "the project is MIT-licensed (SPDX string, PEP 639)"
    assert proj["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").startswith("MIT License")


def _imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for folder in CODE:
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts or path.is_symlink() or not path.is_file():
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for n in names:
                    top = n.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "specbench" and top not in NOT_DISTS:
                        out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_import_is_declared() -> None:
    declared = _declared()
    undeclared = {m: sorted(files)[:3] for m, files in _imports().items()
                  if DIST.get(m, m).lower().replace("_", "-") not in declared}
    assert not undeclared, f"imported but declared nowhere in pyproject (core or an extra): {undeclared}"


def test_optional_modules_sit_in_their_extra() -> None:
    declared = _declared()
    assert declared["transformers"] >= {"hf", "test"} and "core" not in declared["transformers"]
    assert declared["pandas"] >= {"frames", "test"} and "core" not in declared["pandas"]
    assert declared["nvtx"] == {"gpu"}
    assert "pyyaml" in declared and "eval" in declared["pyyaml"]
    assert "datasets" not in declared, "our code never imports datasets (lm-eval brings its own)"
    assert {"starlette", "jinja2", "rich"} <= {d for d, g in declared.items() if "core" in g}


def _constraints() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            out[name.lower().replace("_", "-")] = version
    return out


def test_constraints_pin_every_declared_requirement() -> None:
    pins = _constraints()
    declared = _declared()
    gpu_only = {d for d, g in declared.items() if g == {"gpu"}}  # not installed by `make setup` on CPU
    unpinned = sorted(d for d in declared if d not in pins and d not in gpu_only | {"specbench", "torch"})
    assert not unpinned, f"constraints.txt pins no version of {unpinned}: regenerate it (see its header)"
    assert "torch" not in pins, "torch is chosen by the Makefile (CPU or CUDA build), not pinned here"
