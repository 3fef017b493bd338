"""The engine is provably the same model as HF transformers' Qwen3ForCausalLM (fp32, CPU).

Greedy tokens identical and logprobs within 1e-4 for mixed-length prompts; a batch of 10 requests of
different lengths (with a small prefill budget, so prompts are chunked and batches mix prefill and decode)
equals one-at-a-time.
"""

import pytest
import torch

from specbench.engine import LLM, SamplingParams

MAX_NEW = 12


@pytest.fixture(scope="module")
def hf_model(tiny_target):
    transformers = pytest.importorskip("transformers")
    return transformers.Qwen3ForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_target):
    import json

    g = torch.Generator().manual_seed(0)
    llm_vocab = min(1000, json.loads(open(f"{tiny_target}/config.json").read())["vocab_size"])
    lens = [1, 3, 7, 16, 17, 31, 40, 64, 5, 90]
    return [torch.randint(3, llm_vocab, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def batched(tiny_target, prompts):
    llm = LLM(tiny_target, max_num_batched_tokens=48, num_pages=256)
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))


def test_greedy_and_logprobs_match_hf(hf_model, prompts, batched):
    worst = 0.0
    for p, out in zip(prompts, batched, strict=True):
        with torch.no_grad():
            g = hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                  return_dict_in_generate=True, output_logits=True, pad_token_id=0)
        hf_tokens = g.sequences[0, len(p):].tolist()
        assert out.output_ids == hf_tokens, f"prompt len {len(p)}: engine {out.output_ids} vs HF {hf_tokens}"
        for i, lg in enumerate(g.logits):
            lp = torch.log_softmax(lg[0].float(), -1)
            chosen, top = out.logprobs[i]
            worst = max(worst, abs(lp[hf_tokens[i]].item() - chosen))
            for tok, v in top.items():
                worst = max(worst, abs(lp[tok].item() - v))
    assert worst < 1e-4, f"max |delta logprob| {worst:.2e}"


def test_batched_equals_one_at_a_time(tiny_target, prompts, batched):
    llm = LLM(tiny_target, num_pages=64)
    for p, out in zip(prompts, batched, strict=True):
        single = llm.generate([p], SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=5))[0]
        assert single.output_ids == out.output_ids
        for (a, _), (b, _) in zip(single.logprobs, out.logprobs, strict=True):
            assert abs(a - b) < 1e-4


def test_prompt_logprobs_match_hf(hf_model, tiny_target, prompts):
    llm = LLM(tiny_target, max_num_batched_tokens=32, num_pages=64)
    p = prompts[-1]  # 90 tokens: three prefill chunks
    out = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for pos in range(1, len(p)):
        chosen, top = out.prompt_logprobs[pos]
        assert abs(chosen - lp[pos - 1, p[pos]].item()) < 1e-4
        assert set(top) == set(torch.topk(lp[pos - 1], 3).indices.tolist())
