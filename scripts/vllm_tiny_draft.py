"""Distil a DFlash drafter for the bundled tiny target that vLLM and the bundled engine read the same way.

Why (issue 28): the bundled tiny drafter taps target layers [1, 3], and 3 is the target's last layer. Z Lab's
reference (dflash/model.py, `extract_context_feature`) takes HF `hidden_states[id + 1]`, and HF's last entry is
the FINAL-NORMED output; the bundled engine keeps that meaning (engine/models/qwen3.py `finish`). vLLM 0.26
adds 1 to the ids and captures `hidden + residual` after decoder layer `id` (interfaces.py
`_maybe_add_hidden_state`), i.e. the output BEFORE the final norm, for every layer including the last. So
vLLM serves the [1, 3] drafter, but feeds it un-normed features for layer 3, which it was never trained on.
For any id below the last layer all three agree. Z Lab's own layer picker never selects the last layer
(`build_target_layer_ids`: ids in [1, L - 3]), so published drafters never meet the difference.

This script keeps the bundled target and distils a drafter with target_layer_ids [1, 2] (settings otherwise
those of the bundled build, harness/fixtures/build.py), into harness/data/fixtures/tiny-l12/draft, with a
BUILD.json. Usage: python scripts/vllm_tiny_draft.py [--threads 1] [--out DIR] [--no-measure]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specbench.harness.fixtures.accept import greedy_generate, measure_acceptance, target_data
from specbench.harness.fixtures.build import TinySettings
from specbench.harness.fixtures.data import CHAT_EVERY, chat_prompt, gsm8k, prompt
from specbench.harness.fixtures.drafter import (
    draft_config,
    drafter_tensors,
    new_drafter,
    save_drafter,
    train_drafter,
)
from specbench.harness.fixtures.io import write_json

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "harness" / "data" / "fixtures" / "tiny"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "harness" / "data" / "fixtures" / "tiny-l12"))
    ap.add_argument("--layers", default="1,2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-measure", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ids = [int(x) for x in a.layers.split(",")]
    st = TinySettings(target_layer_ids=tuple(ids))
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(TINY / "target" / "tokenizer.json"))
    target = AutoModelForCausalLM.from_pretrained(str(TINY / "target"), torch_dtype=torch.float32).eval()
    tcfg = json.loads((TINY / "target" / "config.json").read_text())  # the file: transformers 5 moves rope_theta
    mask_id = json.loads((TINY / "draft" / "config.json").read_text())["dflash_config"]["mask_token_id"]
    eos = tcfg["eos_token_id"]
    pad = eos[0] if isinstance(eos, list) else eos
    t0 = time.perf_counter()
    rows = gsm8k("train")
    picks = random.Random(a.seed + 3).sample(range(len(rows)), st.distill_prompts)
    texts = [chat_prompt(rows[i]["question"]) if n % CHAT_EVERY == 0 else prompt(rows[i]["question"])
             for n, i in enumerate(picks)]
    prompts = [e.ids for e in tok.encode_batch(texts)]
    seqs = greedy_generate(target, prompts, st.distill_new_tokens, pad_id=pad)
    data = target_data(target, seqs, [len(p) for p in prompts], ids)
    t1 = time.perf_counter()
    print(f"distill data: {len(data)} sequences ({t1 - t0:.0f}s)", flush=True)
    dcfg = draft_config(tcfg, mask_id, ids, st.block_size, st.draft_layers)
    drafter = new_drafter(dcfg, tcfg["hidden_size"], a.seed)
    embed = target.get_input_embeddings().weight.detach().clone()
    dres = train_drafter(drafter, embed, data, st.draft_steps, a.seed, st.draft_seqs_per_step,
                         st.draft_anchors_per_seq, st.draft_lr, log_every=50)
    t2 = time.perf_counter()
    out = Path(a.out)
    save_drafter(out / "draft", dcfg, drafter_tensors(drafter))
    acc = None
    if not a.no_measure:
        test = gsm8k("test")[:st.eval_prompts]
        ep = [tok.encode(prompt(r["question"])).ids for r in test]
        es = [greedy_generate(target, [p], st.eval_new_tokens, pad)[0] for p in ep]
        acc = measure_acceptance(drafter, embed, target_data(target, es, [len(p) for p in ep], ids))
        acc["prompts"] = f"gsm8k test[:{st.eval_prompts}], zero-shot 'Question: ...\\nAnswer:'"
        print(f"acceptance: mean accepted length {acc['mean_accept_len']:.3f}", flush=True)
    write_json(out / "BUILD.json", {
        "what": "DFlash drafter for harness/data/fixtures/tiny/target tapping layers "
                f"{ids} (none is the last layer, so vLLM and the bundled engine feed it the same features)",
        "target": "harness/data/fixtures/tiny/target (unchanged)",
        "script": "scripts/vllm_tiny_draft.py", "seed": a.seed, "threads": a.threads,
        "settings": asdict(st), "torch": torch.__version__,
        "times": {"distill_data_s": round(t1 - t0, 1), "drafter_s": round(t2 - t1, 1)},
        "drafter_loss": {"first": round(dres.losses[0], 4), "last20_mean": round(sum(dres.losses[-20:]) / 20, 4)},
        "acceptance": acc,
    })
    print(f"wrote {out / 'draft'}", flush=True)


if __name__ == "__main__":
    main()
