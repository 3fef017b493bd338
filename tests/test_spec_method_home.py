"""One home for the spec-method rule and the engine's vocabularies (issue 46, point 1).

engine/config.py imports no torch, so the harness imports its vocabularies and `spec_method` instead of copying
them; every front door (LLM, the local adapter, engine strings, sweep labels, serve) resolves `spec` by that one
rule; each engine-string option that sets an EngineConfig field is converted by the field's type.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specbench.engine.config import (
    ATTENTION_BACKENDS,
    DECODE_ATTENTION,
    DTYPES,
    FRONT_DOOR_METHODS,
    INTERNAL_SPEC_METHODS,
    PADDED_ROWS,
    SPEC_CHOICES,
    SPEC_METHODS,
    SPEC_POLICIES,
    ConfigError,
    EngineConfig,
    SpecConfig,
    engine_method,
    spec_method,
)
from specbench.harness import engines

# (spec, drafter given, what the rule resolves it to)
RULE = [(None, True, "dflash"), (None, False, "off"), ("auto", True, "dflash"), ("auto", False, "off"),
        ("on", True, "dflash"), ("on", False, "ngram"), ("off", True, "off"), ("off", False, "off"),
        ("dflash", True, "dflash"), ("ngram", True, "ngram"), ("ngram", False, "ngram")]
REFUSED = ["oracle", "medusa", "", "ON", "Off"]

PROBE = """
import json, sys
seen = {}
for name in sys.argv[1:]:
    __import__(name)
    seen[name] = "torch" in sys.modules
print(json.dumps(seen))
"""


def _torch_after(*modules: str) -> dict[str, bool]:
    """In a fresh interpreter: whether torch is loaded after importing each module in turn."""
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)


def test_config_and_engine_strings_import_without_torch() -> None:
    seen = _torch_after("specbench.engine.config", "specbench.engine", "specbench.harness.engines")
    assert seen == {"specbench.engine.config": False, "specbench.engine": False, "specbench.harness.engines": False}
    # the probe sees torch where it is imported: the kernels need it, and so does the engine's LLM (lazily)
    assert _torch_after("specbench.kernels", "specbench.engine.llm") == {"specbench.kernels": True,
                                                                         "specbench.engine.llm": True}


def test_the_engine_package_loads_its_torch_names_on_first_use() -> None:
    import specbench.engine as pkg
    from specbench.engine import LLM, AdmissionError, LLMEngine, RequestOutput
    from specbench.engine.engine import LLMEngine as engine_cls
    from specbench.engine.llm import LLM as llm_cls

    assert LLM is llm_cls and LLMEngine is engine_cls and issubclass(AdmissionError, Exception)
    assert RequestOutput.__module__.startswith("specbench.engine.")
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        pkg.Nope  # noqa: B018


@pytest.mark.parametrize(("spec", "drafter", "method"), RULE)
def test_spec_method_rule(spec, drafter, method) -> None:
    assert spec_method(spec, "/d" if drafter else None) == method
    assert engine_method(method) == (None if method == "off" else method)


@pytest.mark.parametrize("spec", REFUSED)
def test_spec_method_refuses_anything_else_in_one_line(spec) -> None:
    with pytest.raises(ConfigError) as e:
        spec_method(spec, "/d")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"spec={spec!r} is invalid: expected ")
    assert all(word in msg for word in (*SPEC_CHOICES, "auto", "on", "null"))


def test_front_door_vocabulary_is_the_engines_less_its_internal_methods() -> None:
    assert set(INTERNAL_SPEC_METHODS) < set(SPEC_METHODS)
    assert SPEC_CHOICES == ("off", *FRONT_DOOR_METHODS)
    assert set(FRONT_DOOR_METHODS) == set(SPEC_METHODS) - set(INTERNAL_SPEC_METHODS)
    for choice in SPEC_CHOICES:  # every front-door name is a method the engine takes
        assert SpecConfig(method=engine_method(choice)).enabled == (choice != "off")


class _Built(Exception):
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg


def _adapter_method(monkeypatch, spec: str | None, draft: str | None) -> str | None:
    """SpecConfig.method of the engine LocalAdapter.from_dirs would build (the engine itself not built)."""
    from specbench.harness.adapters import local

    def built(cfg: EngineConfig, **_: object) -> None:
        raise _Built(cfg)

    monkeypatch.setattr(local, "LLMEngine", built)
    with pytest.raises(_Built) as e:
        local.LocalAdapter.from_dirs("m", draft=draft, spec=spec)
    return e.value.cfg.spec.method


NOT_TAKEN = object()  # a `spec` a front door does not take (engine strings: the switches on / auto)


def _doors(monkeypatch) -> dict:
    """Each front door's reading of `spec`, as the SpecConfig.method (or the label) it yields."""
    from specbench.engine import LLM
    from specbench.suites.sweep.session import arm_labels

    def label(spec: str | None, draft: str | None) -> str:
        raw = "local" + (f",draft={draft}" if draft else "") + (f",spec={spec}" if spec else "")
        return arm_labels([engines.parse_engine(raw)])[0]

    return {
        "LLM": lambda s, d: LLM.config("m", draft=d, spec=s).spec.method,
        "local adapter": lambda s, d: _adapter_method(monkeypatch, s, d),
        # engine strings take the resolved names and "not said", not the switches (as before)
        "sweep label": lambda s, d: label(s, d) if s is None or s in SPEC_CHOICES else NOT_TAKEN,
    }


def _disagreements(monkeypatch, tmp_path: Path) -> list[str]:
    out = []
    for door, read in _doors(monkeypatch).items():
        for spec, drafter, method in RULE:
            got = read(spec, str(tmp_path) if drafter else None)
            want = f"spec-{method}" if door == "sweep label" else engine_method(method)
            if got is not NOT_TAKEN and got != want:
                out.append(f"{door}: spec={spec!r} drafter={drafter}: {got!r}, the rule says {want!r}")
    return out


def test_every_front_door_reads_spec_by_the_one_rule(monkeypatch, tmp_path) -> None:
    assert _disagreements(monkeypatch, tmp_path) == []


def test_a_front_door_with_a_rule_of_its_own_is_caught(monkeypatch, tmp_path) -> None:
    """The engine side's old reading (None = off) in LLM: the check above names the cases it gets wrong."""
    from specbench.engine import llm

    def old_rule(spec, draft):
        return "off" if spec in (None, "off") else spec_method(spec, draft)

    monkeypatch.setattr(llm, "spec_method", old_rule)
    assert _disagreements(monkeypatch, tmp_path) == ["LLM: spec=None drafter=True: None, the rule says 'dflash'"]


@pytest.mark.parametrize("spec", ["oracle", "medusa"])
def test_every_front_door_refuses_a_method_it_may_not_name(monkeypatch, spec) -> None:
    from specbench.engine import LLM

    with pytest.raises(ConfigError, match=f"spec='{spec}'"):
        LLM.config("m", spec=spec)
    with pytest.raises(ConfigError, match=f"spec='{spec}'"):
        _adapter_method(monkeypatch, spec, None)
    with pytest.raises(engines.EngineStringError, match=f"spec='{spec}' is invalid: expected one of off, dflash, "
                                                         "ngram"):
        engines.parse_engine(f"local,spec={spec}")


@pytest.mark.parametrize("spec", ["oracle", "on", "auto"])
def test_serve_refuses_a_spec_outside_the_front_door_names(spec) -> None:
    from specbench.cli.serve import serve

    app = typer.Typer()
    app.command()(serve)
    r = CliRunner().invoke(app, ["--spec", spec, "--port", "0"])
    assert r.exit_code == 2
    assert f"--spec={spec!r} is invalid: expected dflash, ngram or off" in r.output


VOCABULARIES = [("spec", SPEC_CHOICES, None), ("dtype", DTYPES, "dtype"),
                ("attention", ATTENTION_BACKENDS, "attention_backend"),
                ("decode_attention", DECODE_ATTENTION, "decode_attention"), ("padded_rows", PADDED_ROWS, "padded_rows"),
                ("policy", SPEC_POLICIES, None)]


@pytest.mark.parametrize(("option", "words", "config_field"), VOCABULARIES)
def test_engine_strings_take_the_configs_vocabularies(option, words, config_field) -> None:
    for w in words:
        assert engines.parse_engine(f"local,{option}={w}").options[option] == w
        if config_field:
            assert getattr(EngineConfig(model="m", **{config_field: w}), config_field) == w
    with pytest.raises(engines.EngineStringError, match=f"{option}='bogus' is invalid: expected one of "
                                                         f"{', '.join(words)}"):
        engines.parse_engine(f"local,{option}=bogus")
    if config_field:
        with pytest.raises(ConfigError, match=f"{config_field}='bogus'"):
            EngineConfig(model="m", **{config_field: "bogus"})


def _unmapped() -> list[str]:
    """Local options that set neither an EngineConfig field nor a LocalAdapter.from_dirs argument."""
    import inspect

    from specbench.harness.adapters.local import LocalAdapter

    names = {f.name for f in fields(EngineConfig)}
    params = set(inspect.signature(LocalAdapter.from_dirs).parameters)
    arm = {"draft", "spec", "k", "device", "dtype", "name"} | {o for o, (arg, _) in engines.SPEC_ARGS.items()
                                                                if arg in params}
    return [o for o in engines.OPTIONS["local"]
            if not (engines.ENGINE_FIELDS.get(o) in names or (o in arm and o not in engines.ENGINE_FIELDS))]


def test_every_local_option_sets_a_config_field_or_a_from_dirs_argument() -> None:
    assert _unmapped() == []


# one value per EngineConfig option, and what from_dirs must receive for it (typed by the field)
SAMPLE = {"num_pages": ("3", 3), "faults": ("a+b", ("a", "b")), "max_model_len": ("9", 9),
          "max_num_seqs": ("4", 4), "attention": ("torch", "torch"), "decode_attention": ("flashinfer", "flashinfer"),
          "padded_rows": ("bucket", "bucket"), "gpu_memory_utilization": ("0.5", 0.5), "invariants": ("0", False),
          "prefix_cache": ("off", False), "prefix_cache_pages": ("7", 7), "capture_mb": ("1.5", 1.5),
          "whole_prefill": ("16", 16), "tp_emulate": ("2", 2), "graph_runner": ("1", True), "eager": ("yes", True),
          "gemv": ("0", False)}


def test_engine_options_reach_the_config_typed_by_their_field(monkeypatch) -> None:
    from specbench.harness.adapters import local

    seen: dict = {}
    monkeypatch.setattr(local.LocalAdapter, "from_dirs", classmethod(lambda cls, *a, **kw: seen.update(kw)))
    monkeypatch.setattr(engines, "bundled", lambda: ("target", None))
    raw = ",".join(["local", "spec=ngram", "mix=0.25", "tau=2", "gate=3", "trim=1", "policy=auto",
                    "spec_logprobs=0", *(f"{o}={v}" for o, (v, _) in SAMPLE.items())])
    engines.build_adapter(raw)
    want = {engines.ENGINE_FIELDS[o]: typed for o, (_, typed) in SAMPLE.items()}
    want |= {"synthetic_tau": 2.0, "ngram_mix": 0.25, "spec_gate": 3, "spec_trim": 1, "spec_policy": "auto",
             "spec_logprobs": False}
    given = {k: v for k, v in seen.items() if k not in ("spec", "k", "device", "dtype", "name", "draft")}
    assert given == want and all(type(given[k]) is type(v) for k, v in want.items())
    cfg_kw = {k: v for k, v in given.items() if k in engines.ENGINE_FIELDS.values()}
    assert EngineConfig(model="m", **cfg_kw).attention_backend == "torch"  # every value is one the config takes


def test_an_option_mapped_to_no_field_is_caught(monkeypatch) -> None:
    """An option mapped to a field EngineConfig does not have (or a speculation argument from_dirs does not take)
    is named by the check above, and engine_kw refuses to convert it (no field type)."""
    monkeypatch.setitem(engines.ENGINE_FIELDS, "attention", "attention")
    monkeypatch.setitem(engines.SPEC_ARGS, "tau", ("tau", float))
    assert _unmapped() == ["tau", "attention"]
    with pytest.raises(KeyError, match="attention"):
        engines.engine_kw({"attention": "torch"})
