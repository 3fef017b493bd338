"""Prompt sets of the sampled gate: gsm8k questions, and echo prompts built through the baseline.

Contract: `load_prompts(n, max_chars)` returns the first n gsm8k test questions as (pid, text);
`echo_prompts(baseline, prompts)` appends the baseline's greedy answer and the question again (one
greedy request per prompt through the adapter, so it works for any engine); `repeat_prompts(prompts)` ends
each question with the start of a number whose digits repeat ("Answer: 1" + REPEAT_RUN zeros); `make_prompts`
builds `opts.num_prompts` prompts of every set `opts.prompt_set` names (comma-separated, in that order).
Both arms of a comparison always get the same prompt texts. `request(text, chat, ...)` is
the one place a prompt text becomes a request: a text prompt, or with chat (--endpoint-type chat) one user
message for /v1/chat/completions (the server's chat template renders it).
"""

from __future__ import annotations

from collections.abc import Sequence

from specbench.harness.adapters.base import EngineAdapter, GenRequest
from specbench.harness.datasets import bundled_prompts

from .config import SampledError, SampledGateOptions


def request(text: str, chat: bool, **kw) -> GenRequest:
    """A prompt text as a completions request, or (chat) as one user message."""
    if chat:
        return GenRequest(messages=[{"role": "user", "content": text}], **kw)
    return GenRequest(prompt=text, **kw)


def load_prompts(n: int, max_chars: int = 400) -> list[tuple[str, str]]:
    """The first n gsm8k test questions in the form the tiny pair was trained on (`gsm8k_prompt`)."""
    rows = bundled_prompts("gsm8k")[:n]
    return [(pid, text if len(text) <= max_chars else text[-max_chars:]) for pid, text in rows]


def echo_prompts(baseline: EngineAdapter, prompts: Sequence[tuple[str, str]],
                 tokens: int = 32, chat: bool = False) -> list[tuple[str, str]]:
    """prompt + the baseline's greedy continuation + a blank line + the prompt again.

    Under such a prompt an engine tends to repeat its earlier answer, so a prompt-lookup (n-gram)
    drafter proposes tokens the target gives moderate probability: accept ratios p/q strictly inside
    (0, 1), the regime in which every sampling fault acts (docs/sampled.md, "Self-test"). With chat the
    greedy answer is the chat route's (the echo prompt is then one user message as well).
    """
    reqs = [request(text, chat, max_tokens=tokens, temperature=0.0, ignore_eos=True, rid=f"echo-{pid}")
            for pid, text in prompts]
    res = baseline.generate_sync(reqs)
    bad = [r.rid for r in res if not r.ok]
    if bad:
        raise SampledError(f"the baseline failed the greedy generations that build the echo prompts: {bad[:3]}")
    return [(f"{pid}-echo", f"{text}{r.text}\n\n{text}") for (pid, text), r in zip(prompts, res, strict=True)]


REPEAT_RUN = 24  # zeros after "Answer: 1" in a repeat prompt


def repeat_prompts(prompts: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Each question followed by " 1" and a run of zeros: the target continues the run, so it gives the token
    it just emitted (and a drafter just drafted) most of its mass at the next position too.

    That is the regime in which a fully accepted run's bonus row p_k overlaps the last draft's q_{k-1}
    (both heavy on the repeated token), so a bonus drawn from the residual (p_k - q_{k-1})^+ instead of p_k
    moves the token distribution by about p_k's mass on it; and the drafts' accept ratios p/q lie inside
    (0, 1), where the ratio-test faults act (docs/sampled.md, "Seeing q and the bonus row"). Drafters accept
    most of such a run, so fully accepted verify steps (bonus rows) are frequent.
    """
    return [(f"{pid}-repeat", f"{text} 1{'0' * REPEAT_RUN}") for pid, text in prompts]


def make_prompts(baseline: EngineAdapter, opts: SampledGateOptions) -> list[tuple[str, str]]:
    rows = load_prompts(opts.num_prompts, opts.prompt_chars)
    out: list[tuple[str, str]] = []
    for name in opts.prompt_sets:
        if name == "echo":
            out += echo_prompts(baseline, rows, chat=opts.endpoint_type == "chat")
        elif name == "repeat":
            out += repeat_prompts(rows)
        else:
            out += rows
    return out
