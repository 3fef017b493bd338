"""The command line: the typer app (app.py) and one module per command. The top layer: it imports suites,
adapters and the harness; nothing imports it."""

from .app import main

__all__ = ["main"]
