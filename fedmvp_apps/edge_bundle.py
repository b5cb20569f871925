"""What a device command reads from its environment, and hands to the library as arguments (the
library, ``edge_client``, reads no environment): which bundle directory it uses when --bundle is not
given (``$FEDMVP_BUNDLE``, then ./bundle; the library is told where it looked so its not-found line can
say so), and which runtimes this device switches off (``$FEDMVP_DISABLED_RUNTIMES``, comma-separated).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from edge_client.bundle import DEFAULT_BUNDLE, ChosenBundleDir
from edge_client.engines import disable_runtimes

BUNDLE_ENV = "FEDMVP_BUNDLE"  # where `--bundle` is not given
BUNDLE_DEFAULT = f"default: ${BUNDLE_ENV}, then ./{DEFAULT_BUNDLE}"  # what --bundle's help says of its default
BUNDLE_HELP = f"Bundle directory ({BUNDLE_DEFAULT})."
BundleDir = Union[Path, ChosenBundleDir]  # what --bundle becomes: a directory given, or the default's
DISABLED_ENV = "FEDMVP_DISABLED_RUNTIMES"  # runtimes a device must not use (e.g. "openvino")


def switch_off_runtimes() -> None:
    """Tell ``edge_client`` the runtimes ``$FEDMVP_DISABLED_RUNTIMES`` names (every device command and
    the node's executor, anew each time: what was switched off before is replaced)."""
    value = os.environ.get(DISABLED_ENV, "")
    disable_runtimes(value, f"{DISABLED_ENV}={value}")


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
