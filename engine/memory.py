"""KV-pool sizing: a memory profile on the GPU, a simple budget on the CPU.

Bytes per page include the drafter's per-token state (its context K/V lives in the same slot space), so
with a drafter the pool shrinks to fit instead of running out of memory under load.
"""

from __future__ import annotations

import logging

import torch

from .config import EngineConfig, ModelConfig

log = logging.getLogger("specbench.engine")


def bytes_per_token(mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    per = 2 * mcfg.num_hidden_layers * mcfg.kv_size * elem
    if draft is not None:
        per += 2 * draft.num_hidden_layers * draft.kv_size * elem
    return per


def plan_pages(cfg: EngineConfig, mcfg: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype,
               max_len: int) -> int:
    if cfg.num_pages is not None:
        return cfg.num_pages
    per_page = bytes_per_token(mcfg, draft, dtype) * cfg.page_size
    want = cfg.max_num_seqs * -(-max_len // cfg.page_size)
    if torch.device(cfg.device).type == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
        # Leave room for activations of the largest step (logits dominate) and the allocator.
        act = cfg.max_num_batched_tokens * (mcfg.vocab_size * 4 + mcfg.intermediate_size * 6) + (1 << 30)
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - act
        pages = max(1, budget // per_page)
        log.info("KV pool: %d pages (%.2f GiB, %d B/token incl. drafter=%s)", pages,
                 pages * per_page / 2**30, per_page // cfg.page_size, draft is not None)
        return int(min(pages, want))
    # CPU: enough for max_num_seqs full-length requests, capped at 1 GiB.
    return int(max(1, min(want, (1 << 30) // per_page)))
