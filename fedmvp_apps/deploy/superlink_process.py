"""The SuperLink process that `fedmvp serve` starts: Flower's own ``flower-superlink``, with the
operator-only Control API plugin (`fedmvp_apps.deploy.control_auth.OperatorTokenAuthn`).

``python -m fedmvp_apps.deploy.superlink_process ARGS`` takes exactly ``flower-superlink``'s arguments.
Flower's command loads its Control API plugin through one function,
``flwr.superlink.cli.flower_superlink.load_control_authn_plugin`` (the open-source build returns the
no-op plugin there); this entry point answers that call with ours and then runs Flower's command
unchanged. It refuses to start (exit 2, one line) when the token is missing or unreadable, or when
the Flower it finds no longer loads its plugin through that function, so a Flower upgrade can never
silently reopen the Control API. `tests/federated/test_control_api.py` proves the effect against
real processes: an outsider's `flwr ls`, `flwr run`, `flwr stop` and node registration are refused.
"""

from __future__ import annotations

import sys


def main() -> None:
    from fedmvp_apps.deploy.control_auth import OperatorTokenAuthn, OperatorTokenError

    try:
        plugin = OperatorTokenAuthn()
    except OperatorTokenError as err:
        print(f"fedmvp superlink: {err}", file=sys.stderr)
        sys.exit(2)
    import importlib

    command = importlib.import_module("flwr.superlink.cli.flower_superlink")  # the module, not the function

    if not callable(getattr(command, "load_control_authn_plugin", None)):
        print("fedmvp superlink: this Flower does not load its Control API plugin through "
              "load_control_authn_plugin; refusing to start with an open Control API (pin flwr==1.42.*)",
              file=sys.stderr)
        sys.exit(2)
    command.load_control_authn_plugin = lambda: plugin
    sys.argv[0] = "flower-superlink"
    command.flower_superlink()


if __name__ == "__main__":
    main()
