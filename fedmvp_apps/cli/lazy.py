"""A click group whose subcommands import on use, so `--help` and light commands stay fast."""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """Subcommands given as ``{"name": "package.module:attr"}`` and imported only when invoked."""

    def __init__(self, *args, lazy_subcommands: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy_subcommands))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            module_name, attr = self.lazy_subcommands[cmd_name].split(":")
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, cmd_name)
