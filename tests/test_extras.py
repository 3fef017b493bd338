"""Optional features name their extra in one line (specbench/extras.py, cli/app.py main), and `--help` uses
the terminal's width, or 120 columns where there is no terminal (not rich's 80)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specbench.extras import MissingExtra, need

ROOT = Path(__file__).resolve().parents[1]


def test_need_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import of transformers halted: as if absent
    with pytest.raises(MissingExtra) as e:
        need("transformers", "hf", "the hf: adapter")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("the hf: adapter needs transformers, which is not installed: pip install 'specbench[hf]'")


def test_need_reraises_a_broken_install(tmp_path, monkeypatch) -> None:
    """An installed module whose own import fails is a real error, not a missing extra."""
    (tmp_path / "brokenpkg_sb.py").write_text("import no_such_dependency_sb\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError) as e:
        need("brokenpkg_sb", "hf", "x")
    assert not isinstance(e.value, MissingExtra) and e.value.name == "no_such_dependency_sb"


def test_hf_adapter_without_transformers(monkeypatch, tiny_target) -> None:
    from specbench.harness import engines

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtra, match=r"specbench\[hf\]"):
        engines.build_adapter(f"hf:{tiny_target}")


def test_frames_without_pandas(monkeypatch, tmp_path) -> None:
    from specbench.harness import results

    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(MissingExtra, match=r"list_runs needs pandas.*specbench\[frames\]"):
        results.list_runs(tmp_path)


def test_cli_prints_one_line_and_exits_2(monkeypatch, tmp_path, capsys) -> None:
    from specbench.cli import app

    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setattr(sys, "argv", ["specbench", "fixtures", "--out", str(tmp_path / "pair")])
    with pytest.raises(SystemExit) as e:
        app.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("specbench fixtures: building a fixture pair (specbench fixtures) needs transformers")
    assert "pip install 'specbench[hf]'" in err


def _help_width(columns: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    out = subprocess.run([sys.executable, "-m", "specbench", "report", "--help"], cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=True)
    return max(len(line) for line in out.stdout.splitlines())


def test_help_width_without_a_terminal_is_120_not_80() -> None:
    assert _help_width(None) == 120


def test_help_width_follows_columns() -> None:
    assert _help_width("200") == 200
