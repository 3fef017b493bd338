"""Optional features and the pyproject extra that installs each.

`need(module, extra, feature)` imports and returns `module`, or raises `MissingExtra`, whose message is one
line naming the feature, the missing module and the install command; the CLI prints it and exits 2
(cli/app.py main). A module that is installed but fails inside its own imports is not "missing": that
error is re-raised as it is. Anything may import this module (it imports nothing of ours).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional feature was used without its extra installed."""

    def __init__(self, feature: str, module: str, extra: str) -> None:
        self.feature, self.module, self.extra = feature, module, extra
        super().__init__(f"{feature} needs {module}, which is not installed: pip install 'specbench[{extra}]' "
                         f"(in a checkout: .venv/bin/pip install -e '.[{extra}]')", name=module)


def need(module: str, extra: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise  # the module is there, one of its own dependencies is broken: show the real error
        raise MissingExtra(feature, module, extra) from None
