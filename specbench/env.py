"""Reading `SPECBENCH_*` switches from the environment, without torch.

`env_flag(name, default)`: an on/off switch; unset or empty gives `default`, and any value other than 0, false,
off or no (any case) is on. The kernels (`SPECBENCH_TRITON`) and the engine's config defaults read their switches
through it. Anything may import this module (it imports nothing of ours and no third-party package).
"""

from __future__ import annotations

import os

OFF_WORDS = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in OFF_WORDS
