"""The long-running commands (worker, beat, flower, console, dev) log as they go and print no
document: their help does not offer ``--json``, and ``--json`` is refused with a usage error that
says why, before anything starts. Commands that print a result keep the flag in their help."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from proofline.cli import main

FOREGROUND = ["worker", "beat", "flower", "console", "dev"]


@pytest.mark.parametrize("command", FOREGROUND)
def test_help_does_not_offer_json_and_json_is_refused(command: str) -> None:
    runner = CliRunner()
    shown = runner.invoke(main, [command, "--help"])
    assert shown.exit_code == 0 and "--json" not in shown.output, shown.output
    for argv in ([command, "--json"], ["--json", command]):
        refused = runner.invoke(main, argv)
        assert refused.exit_code == 2, (argv, refused.output)
        assert "runs in the foreground and logs as it goes; --json is not available" in refused.output


@pytest.mark.parametrize("argv", [["doctor"], ["manual", "list"], ["console", "add-user"], ["actions", "list"]])
def test_commands_with_a_result_still_offer_json(argv: list[str]) -> None:
    assert "--json" in CliRunner().invoke(main, [*argv, "--help"]).output
