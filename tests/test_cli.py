"""Every `mmserve` subcommand registers: a broken import fails here, not on a user's machine."""

import pytest

from mmserve.cli import SUBCOMMANDS, build_parser


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(["--help"]).parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_each_subcommand_has_a_handler(name):
    subparsers = next(a for a in build_parser([name])._actions if a.dest == "command")
    assert subparsers.choices[name].get_default("func") is not None
