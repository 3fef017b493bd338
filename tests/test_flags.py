"""One vocabulary of flags (issue 24 item 6; docs/cli.md "Flag vocabulary", cli/flags.py): every command that
stores a run takes --results-dir and --record/--no-record, every long command --quiet/-q, --dataset takes the
same names everywhere; each older spelling still parses, to exactly what the new one does."""

from __future__ import annotations

import pytest
import typer.main
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.datasets import BUNDLED, SYNTHETIC

STORES = ("sweep", "tune", "lossless", "sampled", "selftest", "eval", "gaps", "report", "import")
RECORDS = ("sweep", "tune", "lossless", "sampled", "selftest", "eval", "gaps")
LONG = ("sweep", "tune", "lossless", "sampled", "selftest", "eval")
# positional arguments a command needs before its options parse
POSITIONAL = {"gaps": ["trace.json"], "report": ["run-1"], "import": ["vllm-bench", "a.json"]}


def _commands() -> dict:
    _register()
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


def _names(cmd) -> set[str]:
    return {n for p in cmd.params for n in [*p.opts, *p.secondary_opts]}


def _params(name: str, args: list[str]) -> dict:
    cmd = _commands()[name]
    with cmd.make_context(name, [*POSITIONAL.get(name, []), *args]) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("name", STORES)
def test_every_store_takes_results_dir(name: str) -> None:
    assert "--results-dir" in _names(_commands()[name])


@pytest.mark.parametrize("name", RECORDS)
def test_every_stored_run_takes_record_and_no_record(name: str) -> None:
    assert {"--record", "--no-record"} <= _names(_commands()[name])


@pytest.mark.parametrize("name", LONG)
def test_every_long_command_takes_quiet(name: str) -> None:
    assert {"--quiet", "-q"} <= _names(_commands()[name])


# (command, the native flag's args, its alias's args, the parameter, its value)
ALIASES = [
    ("sweep", ["--results-dir", "R"], ["--out", "R"], "out", "R"),
    ("tune", ["--results-dir", "R"], ["--out", "R"], "out", "R"),
    ("import", ["--results-dir", "R"], ["--out", "R"], "out", "R"),
    ("lossless", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("sampled", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("selftest", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("eval", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("gaps", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("report", ["--results-dir", "R"], ["--results", "R"], "results", "R"),
    ("sweep", ["--quiet"], ["--no-progress"], "quiet", True),
    ("sweep", ["--quiet"], ["-q"], "quiet", True),
    ("tune", ["--quiet"], ["--no-progress"], "quiet", True),
    ("tune", ["--quiet"], ["-q"], "quiet", True),
    ("sweep", [], ["--progress"], "quiet", False),
    ("tune", [], ["--progress"], "quiet", False),
    ("lossless", ["--quiet"], ["-q"], "quiet", True),
    ("eval", ["--quiet"], ["-q"], "quiet", True),
    ("gaps", ["--report", "m.md"], ["--markdown", "m.md"], "markdown", "m.md"),
]


@pytest.mark.parametrize("name, native, alias, param, value", ALIASES)
def test_each_alias_parses_to_what_its_native_flag_does(name, native, alias, param, value) -> None:
    a, b = _params(name, native), _params(name, alias)
    assert a == b  # every parameter, not just this one
    got = a[param]
    assert (str(got) if value not in (True, False) else got) == value


@pytest.mark.parametrize("name", RECORDS)
def test_record_flags(name: str) -> None:
    assert _params(name, [])["record"] is True and _params(name, ["--record"])["record"] is True
    assert _params(name, ["--no-record"])["record"] is False


def test_dataset_names_are_spelled_alike_everywhere() -> None:
    from specbench.cli.sweep import DATASETS as SWEEP
    from specbench.cli.sweep import _dataset_name
    from specbench.suites.lossless.prompts import DATASETS as LOSSLESS
    from specbench.suites.sweep.workload import DATASETS as WORKLOAD

    assert SWEEP == WORKLOAD == BUNDLED + SYNTHETIC and set(BUNDLED) <= set(LOSSLESS)
    for d in SWEEP:
        assert _dataset_name(d.replace("_", "-").upper(), "--dataset") == d
    with pytest.raises(typer.BadParameter, match="humaneval"):  # the error lists every name
        _dataset_name("nope", "--dataset")


@pytest.mark.parametrize("spelling", ["Spec-Bench", "mt-bench", "humaneval"])
def test_lossless_takes_the_same_spellings(spelling: str) -> None:
    _register()
    # the data set passes; the run then stops at the engine string, after the --dataset check
    r = CliRunner().invoke(app, ["lossless", "--no-record", "--dataset", spelling, "--candidate", "local:/no/such/dir"])
    assert r.exit_code == 2 and "--dataset" not in r.output and "does not exist" in r.output, r.output
    r = CliRunner().invoke(app, ["lossless", "--no-record", "--dataset", "random"])
    assert r.exit_code == 2 and "--dataset 'random' is invalid" in r.output


def test_sweep_runs_humaneval_as_lossless_does(monkeypatch, tmp_path) -> None:
    from test_progress import _fake_sweep_arms

    _fake_sweep_arms(monkeypatch)
    _register()
    r = CliRunner().invoke(app, ["sweep", "-c", "1", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "1",
                                 "--warmup", "0", "--no-noise-floor", "--dataset", "humaneval", "-q", "--arms",
                                 "openai:http://a,name=A,openai:http://b,name=B", "--results-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    from specbench.harness.results import load_stored_run

    (run_dir,) = tmp_path.iterdir()
    meta = load_stored_run(run_dir).meta
    assert meta["config"]["dataset"] == "humaneval", meta


def test_eval_no_record_keeps_nothing(monkeypatch, tmp_path) -> None:
    import tempfile

    from test_progress import _fake_eval

    _fake_eval(monkeypatch)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    store = tmp_path / "store"
    _register()
    r = CliRunner().invoke(app, ["eval", "--limit", "2", "--num-fewshot", "0", "--results-dir", str(store),
                                 "--no-record", "-q"])
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().endswith("results: not kept (--no-record)") and "Per-sample outputs" not in r.stdout
    assert not store.exists() and not list(scratch.iterdir())
