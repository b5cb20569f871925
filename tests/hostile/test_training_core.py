"""Hostile input to the training core (`fedmvp train`, `evaluate`, `world`, `ingest`): one line, a
meaningful exit code, nothing changed. Rows that would need training fail before it starts."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from fedmvp.cli import SUBCOMMANDS, main


def _float_flags() -> list[tuple[str, str]]:
    """(subcommand, --flag) of every float option of the `fedmvp` command line."""
    ctx = click.Context(main)
    out = []
    for name in SUBCOMMANDS:
        command = main.get_command(ctx, name)
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, click.types.FloatParamType):
                out.append((name, param.opts[0]))
    return out


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("command,flag", _float_flags())
def test_every_float_flag_refuses_non_finite_values(command, flag, value):
    """No range check catches NaN (`x < 0` is false), so each float flag checks finiteness itself."""
    from fedmvp.cli.common import FiniteFloat

    param = next(p for p in main.get_command(click.Context(main), command).params if flag in p.opts)
    assert isinstance(param.type, FiniteFloat), f"fedmvp {command} {flag} is a plain float"
    with pytest.raises(click.BadParameter, match="not a finite number|not in the range"):
        param.type.convert(value, param, None)


def test_the_float_flags_are_found():
    assert {("serve", "--fraction"), ("serve", "--round-timeout"), ("pretrain-tiny", "--lr")} <= set(_float_flags())
