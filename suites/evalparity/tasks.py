"""The lm-eval task definitions shipped with specbench, rendered for an offline run.

Contract:
- `TASK_DIR` (harness/data/lm_eval_tasks/) holds one YAML per task, each a copy of lm-eval's own task
  whose dataset is a bundled file (`dataset_path: json`, `dataset_kwargs.data_files` relative to the
  YAML's folder). `available_tasks()` lists their `task:` names.
- `render_tasks(names, out_dir)` writes the named tasks into `out_dir` with every data_files path made
  absolute and checked to exist, and returns `out_dir` for lm-eval's `include_path`. Nothing in the
  rendered YAML can reach a hub: a task whose dataset_path is not a local loader is refused.
- A rendered task differs from its source only in those paths, so its `metadata.version` stays the
  lm-eval version it copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent.parent.parent / "harness" / "data" / "lm_eval_tasks"
LOCAL_LOADERS = ("json", "csv", "parquet", "text", "arrow")


class TaskError(ValueError):
    """A task name or task file that cannot be run offline."""


def _load(path: Path) -> dict[str, Any]:
    import yaml  # the eval extra (pyyaml): imported here so `specbench eval` can name the extra when it is missing

    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise TaskError(f"{path}: unreadable task YAML ({e})") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), str):
        raise TaskError(f"{path}: not an lm-eval task (expected a mapping with a 'task' name)")
    return cfg


def _task_dir() -> Path:
    if TASK_DIR.is_dir():
        return TASK_DIR
    # installed (non-editable): the data sits inside the specbench.harness package
    from specbench import harness

    return Path(harness.__file__).resolve().parent / "data" / "lm_eval_tasks"


def task_files() -> dict[str, Path]:
    """task name -> its YAML in the bundled task folder."""
    out: dict[str, Path] = {}
    for p in sorted(_task_dir().glob("*.yaml")):
        out[_load(p)["task"]] = p
    return out


def available_tasks() -> list[str]:
    return sorted(task_files())


def _absolute(cfg: dict[str, Any], base: Path, src: Path) -> dict[str, Any]:
    if cfg.get("dataset_path") not in LOCAL_LOADERS:
        raise TaskError(f"{src}: dataset_path={cfg.get('dataset_path')!r} would need a hub; expected one of "
                        f"{', '.join(LOCAL_LOADERS)} with dataset_kwargs.data_files")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if not isinstance(files, dict) or not files:
        raise TaskError(f"{src}: dataset_kwargs.data_files is missing: expected {{split: path}}")
    resolved: dict[str, str] = {}
    for split, rel in files.items():
        p = (base / str(rel)).resolve()
        if not p.is_file():
            raise TaskError(f"{src}: data_files.{split}={rel!r} -> {p} does not exist (reinstall specbench)")
        resolved[str(split)] = str(p)
    out = dict(cfg)
    out["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": resolved}
    return out


def render_tasks(names: list[str], out_dir: Path) -> Path:
    """Write the named bundled tasks with absolute data paths into out_dir; return out_dir."""
    import yaml

    files = task_files()
    unknown = [n for n in names if n not in files]
    if unknown:
        raise TaskError(f"task {unknown[0]!r} is not bundled: expected one of {', '.join(sorted(files)) or '(none)'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        src = files[name]
        cfg = _absolute(_load(src), src.parent, src)
        (out_dir / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True),
                                              encoding="utf-8")
    return out_dir
