"""A mistyped option gets the command's own usage line and a suggestion (issue 36 item 6).

argparse reported options no command takes with the top-level usage and ``resumekit:
error:``; docs/cli.md promises ``resumekit <command>: error:`` for usage errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from resumekit.cli import main


def test_a_mistyped_flag_gets_the_commands_usage_and_a_did_you_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(tmp_path), "--jsn"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: resumekit inspect ")
    assert err[-1] == ("resumekit inspect: error: unrecognized arguments: --jsn "
                       "(--jsn: did you mean --json?)")


def test_a_mistyped_flag_with_a_value_is_matched_by_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(tmp_path), "--stepp=3"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "resumekit verify: error: unrecognized arguments: --stepp=3 "
        "(--stepp: did you mean --step?)")


def test_an_argument_like_no_option_is_named_without_a_guess(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["prune", str(tmp_path), "--keep-last", "2", "--zzzz", "extra"]) == 2
    err = capsys.readouterr().err
    assert "usage: resumekit prune " in err
    assert err.splitlines()[-1] == ("resumekit prune: error: unrecognized arguments: "
                                    "--zzzz extra")
