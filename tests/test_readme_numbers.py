"""The README's performance section is what the committed reports say (scripts/readme_numbers.py): this
fails `make test` (and so CI) when a report changes without the README, or a number is typed in by hand."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "scripts" / "readme_numbers.py")
assert _spec is not None and _spec.loader is not None
rn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rn)

SOURCES = ("reports/h200-engine/before/speed.json", "reports/h200-qwen3-4b-shape/sweep.md",
           "reports/h200-vllm/h200-vllm.json", "reports/h200-levers/levers.json")


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for rel in SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for extra in (ROOT / "reports" / "h200-engine").glob("*/speed.json"):  # any newer speed report too
        dst = tmp_path / extra.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(extra, dst)
    return tmp_path


def test_readme_numbers_match_the_committed_reports() -> None:
    diff = rn.check(ROOT)
    assert not diff, "README.md differs from the reports; run scripts/readme_numbers.py:\n" + "\n".join(diff[:40])


def test_a_changed_report_fails_the_check(tmp_path) -> None:
    root = _copy(tmp_path)
    sp, d = rn.speed_report(root)
    d["spec_speedup"]["1"]["median"] = 9.87
    sp.write_text(json.dumps(d), encoding="utf-8")
    diff = rn.check(root)
    assert any(line.startswith("+") and "9.87x" in line for line in diff), diff


def test_a_hand_typed_number_fails_the_check(tmp_path) -> None:
    root = _copy(tmp_path)
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8")
    start = text.index(rn.HEADING)
    section_end = text.index("\n## ", start + 1)
    edited = text[:section_end] + "\nspec on serves 2.5x the tokens/s of spec off.\n" + text[section_end:]
    readme.write_text(edited, encoding="utf-8")
    assert any("2.5x the tokens/s" in line for line in rn.check(root))


def test_the_newest_complete_speed_report_is_used(tmp_path) -> None:
    root = _copy(tmp_path)
    _, d = rn.speed_report(root)
    newer = dict(d, environment={**d["environment"], "date": "2099-01-01 00:00:00 UTC"})
    newer["plain_ms_per_step"] = {k: {**v, "median": 1.234} for k, v in d["plain_ms_per_step"].items()}
    incomplete = dict(newer, complete=False, environment={**d["environment"], "date": "2100-01-01 00:00:00 UTC"})
    for name, doc in (("zz-newer", newer), ("zzz-incomplete", incomplete)):
        (root / "reports" / "h200-engine" / name).mkdir()
        (root / "reports" / "h200-engine" / name / "speed.json").write_text(json.dumps(doc), encoding="utf-8")
    section = rn.render(root)
    assert "1.23 ms" in section and "reports/h200-engine/zz-newer/speed.json" in section
    assert "zzz-incomplete" not in section
