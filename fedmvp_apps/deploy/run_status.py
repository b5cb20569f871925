"""A run's status from the SuperLink's Control API, asked in this process.

`fedmvp serve` watches its run once a second until it ends. Asking through the ``flwr ls`` command
started a fresh interpreter each time, which imports Flower's CLI: about 1 s of CPU per look, so
half a core for the whole run, taken from the ServerApp, the SuperLink and (in a trial on one
machine) the sites. Measured on 2 cores, that was a quarter of a deployed round (docs/benchmarks.md,
the deploy section). Here the same ``ListRuns`` request goes through Flower's own Control API client
(``ControlHttpClient``, what ``flwr ls`` builds), with the operator token as its bearer
(`control_auth`: the SuperLink admits nobody else), on one connection kept for the run. The same
client submits the run (what `flwr run` sends, without its interpreter), stops it when `serve` is
interrupted: within the stop's bound, where a `flwr stop` interpreter took seconds of it, and
registers the admitted SuperNode keys: a `flwr supernode register`
interpreter a key cost 2-5 s under load, minutes for a fleet of 50 (docs/benchmarks.md, "Fleets").
Each call waits at most ``CALL_SECONDS``.
"""

from __future__ import annotations

import ssl
from pathlib import Path

CALL_SECONDS = 5.0  # one Control API call; the SuperLink answers on the same machine in milliseconds


class OperatorBearer:
    """Flower's protobuf-over-HTTP client interceptor that sends the operator token on every request
    (what ``flwr``'s account interceptor sends from its credential store; there is nothing to refresh)."""

    def __init__(self, token: str) -> None:
        self.header = f"Bearer {token}"

    def intercept(self, context, call_next):
        context.request.headers["Authorization"] = self.header
        return call_next(context)


class RunStatusClient:
    """``status(run_id)``: Flower's status text of one run, as ``flwr ls`` prints it ("running",
    "finished:completed", ...); ``close`` ends the connection."""

    def __init__(self, address: str, token: str, root_certificates: Path | None) -> None:
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

        # What ControlHttpClient.from_server_address builds, with a bound on each call (its default: 30 s).
        self.client = ControlHttpClient(
            f"{'https' if root_certificates else 'http'}://{address}",
            verify=ssl.create_default_context(cafile=str(root_certificates)) if root_certificates else False,
            timeout=CALL_SECONDS,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI"), OperatorBearer(token)])

    def status(self, run_id: int) -> str:
        from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=no-name-in-module

        runs = self.client.ListRuns(ListRunsRequest(run_id=run_id)).run_dict  # an unknown id: an error
        status = runs[run_id].status
        return status.status if not status.sub_status else f"{status.status}:{status.sub_status}"

    def start_run(self, app: Path, run_config: str) -> int:
        """Submit the Flower app folder ``app`` with ``run_config`` (``key=value ...``, as `flwr run
        --run-config` takes it); the new run's id. What `flwr run` sends (the app built into a FAB, the
        overrides, no federation), without a `flwr` interpreter (1-2 s of a `fedmvp serve` start)."""
        import hashlib

        from flwr.cli.build import build_fab_from_disk
        from flwr.common.config import parse_config_args
        from flwr.common.serde import fab_to_proto, user_config_to_proto
        from flwr.proto.control_pb2 import StartRunRequest  # pylint: disable=no-name-in-module
        from flwr.supercore.fab import Fab

        fab_bytes = build_fab_from_disk(app)
        fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
        request = StartRunRequest(fab=fab_to_proto(fab), override_config=user_config_to_proto(
            parse_config_args([run_config])), federation="", app_spec="")
        started = self.client.StartRun(request)
        if not started.HasField("run_id"):
            raise RuntimeError("the SuperLink started no run")
        return int(started.run_id)

    def stop(self, run_id: int) -> bool:
        """Stop run ``run_id`` (what `flwr stop` asks); True if the SuperLink did."""
        from flwr.proto.control_pb2 import StopRunRequest  # pylint: disable=no-name-in-module

        return bool(self.client.StopRun(StopRunRequest(run_id=run_id)).success)

    def register_node(self, public_key: str) -> int:
        """Admit one SuperNode by its OpenSSH public key text (what `flwr supernode register` sends: an
        EC key of a NIST curve, serialised as Flower does); its node id. ValueError: not such a key."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=no-name-in-module
        from flwr.supercore.primitives.asymmetric import public_key_to_bytes, uses_nist_ec_curve

        key = serialization.load_ssh_public_key(public_key.strip().encode())
        if not isinstance(key, ec.EllipticCurvePublicKey) or not uses_nist_ec_curve(key):
            raise ValueError("not an EC public key of a NIST curve")
        node_id = int(self.client.RegisterNode(RegisterNodeRequest(public_key=public_key_to_bytes(key))).node_id)
        if not node_id:
            raise ValueError("the SuperLink registered no node")
        return node_id

    def close(self) -> None:
        self.client.close()
