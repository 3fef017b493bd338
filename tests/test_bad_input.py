"""Bad input is refused with a clear error naming the field; nothing crashes or hangs."""

import json
import shutil

import pytest

from specbench.engine import LLM, AdmissionError, ConfigError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_target):
    return LLM(tiny_target, num_pages=64)


def test_prompt_longer_than_context(llm):
    n = llm.engine.max_model_len + 1
    with pytest.raises(AdmissionError, match="usable context"):
        llm.engine.add_request([5] * n, SamplingParams(max_tokens=1))
    # The engine keeps serving.
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_request_larger_than_pool(tiny_target):
    small = LLM(tiny_target, num_pages=2, page_size=16)
    with pytest.raises(AdmissionError, match="whole pool"):
        small.engine.add_request([5] * 30, SamplingParams(max_tokens=8))


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"stop": 7}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_sampling_params_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


def test_bad_prompts(llm):
    with pytest.raises(AdmissionError, match="empty"):
        llm.engine.add_request([], SamplingParams())
    with pytest.raises(ConfigError, match="out of range"):
        llm.engine.add_request([10**9], SamplingParams())
    with pytest.raises(ConfigError, match="prompt"):
        llm.engine.add_request({"x": 1}, SamplingParams())  # type: ignore[arg-type]


def test_checkpoint_directory_errors(tmp_path, tiny_target):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    d = tmp_path / "m"
    shutil.copytree(tiny_target, d)
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json: missing"):
        LLM(str(d))
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="malformed JSON"):
        LLM(str(d))
    cfg = json.loads(open(f"{tiny_target}/config.json").read())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        LLM(str(d))
    cfg["hidden_size"] = "wide"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        LLM(str(d))
    cfg = json.loads(open(f"{tiny_target}/config.json").read())
    cfg["num_key_value_heads"] = 3
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        LLM(str(d))
    cfg["num_key_value_heads"] = json.loads(open(f"{tiny_target}/config.json").read())["num_key_value_heads"]
    cfg["num_hidden_layers"] += 1  # one layer's tensors are missing from the checkpoint
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="is missing from the checkpoint"):
        LLM(str(d))


def test_unknown_fault_and_spec(tiny_target):
    with pytest.raises(ValueError, match="faults"):
        LLM(tiny_target, faults=("nope",))
    with pytest.raises(ConfigError, match="spec.method"):
        LLM(tiny_target, spec="medusa")
    with pytest.raises(ConfigError, match="drafter"):
        LLM(tiny_target, spec="dflash")


def test_share_gpu_splits_local_cuda_engines_and_names_bad_utilization():
    """Two local CUDA engines in one process get cumulative shares of the device (the first would otherwise
    size its pool over all of it and leave the second none); explicit sizes and CPU engines are left alone."""
    from specbench.harness.engines import EngineStringError, parse_engine, share_gpu

    a = parse_engine("local,spec=off,device=cuda")
    b = parse_engine("local,spec=dflash,device=cuda")
    sa, sb = share_gpu([a, b])
    assert (sa.options["gpu_memory_utilization"], sb.options["gpu_memory_utilization"]) == ("0.425", "0.85")
    assert sb.raw.endswith(",gpu_memory_utilization=0.85")
    fixed = parse_engine("local,spec=off,device=cuda,num_pages=64")
    assert share_gpu([fixed, b]) == [fixed, b]  # only one engine left to size: nothing to split
    cpu = parse_engine("local,spec=off")
    assert share_gpu([cpu, parse_engine("local,spec=dflash")])[1].options.get("gpu_memory_utilization") is None
    with pytest.raises(EngineStringError, match="gpu_memory_utilization='1.5'"):
        parse_engine("local,device=cuda,gpu_memory_utilization=1.5")


def test_ids_past_the_vocabulary_are_refused_at_admission(llm):
    """A stop id the model can never emit would silently stop nothing (it was ignored): refused by name, as a
    logit_bias id past the vocabulary is; the last id of the vocabulary is accepted."""
    v = llm.engine.mcfg.vocab_size
    for kw, field in (({"stop_token_ids": (v,)}, "stop_token_ids"), ({"logit_bias": {v: 1.0}}, "logit_bias")):
        with pytest.raises(ConfigError, match=rf"^{field}=\[{v}\] is out of range: expected token ids 0 <= id < {v}"):
            llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=2, **kw))
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, stop_token_ids=(v - 1,), logit_bias={v - 1: -1.0}))
    assert len(out[0].output_ids) >= 1
