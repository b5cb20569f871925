"""Which bundle directory a device command uses when --bundle is not given: ``$FEDMVP_BUNDLE``, then
./bundle. The environment is the command's to read; the library (``edge_client``) takes the directory
as an argument, and is told where it looked so its not-found line can say so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from edge_client.bundle import DEFAULT_BUNDLE, ChosenBundleDir

BUNDLE_ENV = "FEDMVP_BUNDLE"  # where `--bundle` is not given
BUNDLE_DEFAULT = f"default: ${BUNDLE_ENV}, then ./{DEFAULT_BUNDLE}"  # what --bundle's help says of its default
BUNDLE_HELP = f"Bundle directory ({BUNDLE_DEFAULT})."
BundleDir = Union[Path, ChosenBundleDir]  # what --bundle becomes: a directory given, or the default's


def bundle_dir(given: Path | None) -> BundleDir:
    """``given`` (--bundle) if set, else ``$FEDMVP_BUNDLE``, else ./bundle (the latter two named as such)."""
    if given is not None and str(given) != "":
        return given
    env = os.environ.get(BUNDLE_ENV)
    if env:
        return ChosenBundleDir(Path(env), f"${BUNDLE_ENV}={env}")
    return ChosenBundleDir(Path(DEFAULT_BUNDLE), f"${BUNDLE_ENV} (unset), ./{DEFAULT_BUNDLE}")


def bundle_option_callback(_ctx: object, _param: object, value: Path | None) -> BundleDir:
    """click's callback for --bundle: the directory the command passes to ``edge_client``."""
    return bundle_dir(value)
