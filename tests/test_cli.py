"""The CLI surface: --version, --help on every command, exit code 2 on bad usage."""

import pytest
from typer.testing import CliRunner

from specbench import __version__
from specbench.cli import app as cli

cli._register()
runner = CliRunner()


def test_version():
    r = runner.invoke(cli.app, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_command_has_help(name):
    r = runner.invoke(cli.app, [name, "--help"])
    assert r.exit_code == 0, r.output
    assert "Usage" in r.output


def test_unknown_command_and_option_exit_2():
    assert runner.invoke(cli.app, ["no-such-command"]).exit_code == 2
    assert runner.invoke(cli.app, ["lossless", "--no-such-option"]).exit_code == 2
