"""The Flower app folder `flwr run` submits: written from ``flower_app.toml``, its one definition.

A federation runs one Flower app (docs/architecture.md "Layers"): the ServerApp
``fedmvp.federated.server_app:app``, the ClientApp ``node_app.client_app:app`` and the run-config
keys with their defaults. They live in ``flower_app.toml``, shipped with the package, and nowhere
else: `fedmvp serve` writes the folder beside its run, and for a SuperLink of your own

    python -m fedmvp_apps.deploy.flower_app app/
    flwr run app/ fedmvp --run-config "preset='demo' run-dir='runs/deployed'"

The folder holds only that ``pyproject.toml``: the FAB carries no code, every machine runs the
installed fedmvp.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from string import Template

from fedmvp import __version__
from fedmvp_formats.atomic import write_text

TEMPLATE = "flower_app.toml"


def app_pyproject() -> str:
    """The app's ``pyproject.toml`` text, with this fedmvp's version."""
    text = resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")
    return Template(text).substitute(version=__version__)


def write_app_dir(folder: Path) -> Path:
    """``folder`` (created) holding the app's ``pyproject.toml``; returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "pyproject.toml", app_pyproject())
    return folder


def main(argv: list[str] | None = None) -> None:
    """``python -m fedmvp_apps.deploy.flower_app DIR``: write the app folder, print its path."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m fedmvp_apps.deploy.flower_app DIR  (then: flwr run DIR <superlink> ...)",
              file=sys.stderr)
        sys.exit(2)
    print(write_app_dir(Path(args[0])))


if __name__ == "__main__":
    main()
