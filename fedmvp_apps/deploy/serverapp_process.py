"""The ServerApp process of `fedmvp serve`: Flower's own ``flwr-serverapp``, its Runtime API token
read from standard input (``--token-stdin``) instead of the command line.

`fedmvp_apps.deploy.superexec_process` starts it and writes the token to its stdin, a pipe only the
SuperExec holds, so no other local user sees it in ``ps`` (docs/security.md). Flower's own reader
(``flwr.common.args``, which its other apps use with ``--token-stdin``) reads one bounded line and
checks it is a task token; ``flwr-serverapp`` just does not offer the flag, so this entry point adds
it to that parser and runs Flower's command unchanged. Imports neither ``fedmvp`` nor torch (the
ServerApp imports the federation's app itself).
"""

from __future__ import annotations

import sys
from functools import partial


def main() -> None:
    import importlib

    command = importlib.import_module("flwr.superlink.cli.flwr_serverapp")
    add_common = getattr(command, "add_args_flwr_app_common", None)
    if not callable(add_common):
        print("fedmvp serverapp: this Flower's flwr-serverapp has no add_args_flwr_app_common to take "
              "--token-stdin (pin flwr==1.42.*)", file=sys.stderr)
        sys.exit(2)
    command.add_args_flwr_app_common = partial(add_common, include_token_stdin=True)
    sys.argv[0] = "flwr-serverapp"
    command.flwr_serverapp()


if __name__ == "__main__":
    main()
