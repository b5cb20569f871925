"""The warm ClientApp executor: one long-lived process runs every message its SuperNode receives.

Flower's default (``flower-supernode --isolation subprocess``) starts a fresh ``flwr-clientapp``
process per message, so a site imports torch, loads CLIP and rebuilds its data index every round
(~18 s a steady round on the demo preset; docs/benchmarks.md "deploy"). With ``--isolation process`` the SuperNode
starts nothing itself: an executor claims each pending task on the SuperNode's Runtime API and
runs it. This module is that executor, in ONE process: it claims tasks as Flower's SuperExec does
(``AcquireTask``, ClientApp tasks only) and runs each as ``flwr-clientapp`` does (the same Flower
functions: pull the task input, install the FAB, load the ClientApp, push the reply and the task
output), but in-process, so module-level caches (a site's ``fedmvp.federated.task.task_context``,
an edge device's bundle session) survive between messages: Flower issue #3670, the long-running
ClientApp of PR #4039. Flower's loader reuses an imported module (``sys.modules``), so the
ClientApp object and its caches are loaded once.

One task is `fedmvp_apps.deploy.warm_task.run_one`: nothing of a task outlives it (its token,
context, message, Flower's ``TaskIdentity``), a task the SuperNode drops (its run ended, its message
could not be received) ends only that task, and every message pulled is answered, so the process
serves run after run: a `fedmvp serve` killed and restarted submits a new run that the same warm
sites serve (tests/federated/test_faults.py).

What this uses of Flower that is not its CLI lives in ``_flower()``, one place: a Flower that
moved a name fails there with one line naming it. Imports neither ``fedmvp`` nor torch (an edge
install runs it: docs/architecture.md "Layers"), except a ``--preflight`` module its join names: checks
that need the libraries the first message loads anyway, run once here before the SuperNode starts
(`run_preflight`; a ``[federation]`` site's, `fedmvp_apps.cli.join_preflight`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from logging import INFO, WARNING
from types import SimpleNamespace
from typing import Any

from fedmvp_apps.deploy.preflight import EXIT_REFUSED, PASSED, REFUSED
from fedmvp_apps.deploy.warm_task import dropped, retry_invoker, run_one

# The SuperExec auth (HMAC) guards AcquireTask: only the holder of the join's secret claims tasks.
PROTECTED_METHODS = ("/flwr.proto.Runtime/AcquireTask",)
POLL_SECONDS = 0.2  # between two AcquireTask calls while idle (Flower's SuperExec: 1 s)
EXIT_FLOWER_CHANGED = 3


class FlowerChanged(RuntimeError):
    """This Flower lacks a function the warm executor uses (written against flwr 1.42)."""


def _flower() -> SimpleNamespace:
    """Every Flower name the executor uses, imported in one place (a changed Flower: one line)."""
    try:
        import httpx
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.common.serde import context_from_proto, context_to_proto, fab_from_proto, message_from_proto, \
            run_from_proto
        from flwr.proto.node_pb2 import Node  # pylint: disable=E0611
        from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
            AcquireTaskRequest,
            PullAppMessagesRequest,
            PullTaskInputRequest,
            PushTaskOutputRequest,
            SendTaskHeartbeatRequest,
        )
        from flwr.supercore import log
        from flwr.supercore.constant import TaskType
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.inflatable.inflatable_protobuf_utils import (
            make_confirm_message_received_fn_protobuf,
            make_pull_object_fn_protobuf,
        )
        from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
        from flwr.supercore.interceptors import (
            RuntimeTokenHttpInterceptor,
            RuntimeVersionHttpInterceptor,
            SuperExecAuthHttpInterceptor,
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supercore.task_identity import TaskIdentity
        from flwr.supernode.runtime.run_clientapp import push_message
    except ImportError as err:
        import flwr

        raise FlowerChanged(f"the warm ClientApp executor needs flwr 1.42's runtime API, this flwr "
                            f"{getattr(flwr, '__version__', '?')} lacks it ({err})") from None
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "err"})


@dataclass
class Executor:
    """Claims the SuperNode's ClientApp tasks and runs each in this process (`warm_task.run_one`)."""

    runtime_api_address: str
    secret: bytes | None = None
    poll: float = POLL_SECONDS
    tasks_done: int = 0

    def __post_init__(self) -> None:
        self.flwr = _flower()
        interceptors: list[Any] = [self.flwr.RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if self.secret:
            interceptors.append(self.flwr.SuperExecAuthHttpInterceptor(master_secret=self.secret,
                                                                       protected_methods=PROTECTED_METHODS))
        self.client = self._client(interceptors)
        self.load_client_app = self.flwr.get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)

    def _client(self, interceptors: list[Any]):
        # The Runtime API is the SuperNode's own, on this machine's loopback (supernode.py binds it there).
        return self.flwr.RuntimeHttpClient.from_server_address(
            server_address=self.runtime_api_address, insecure=True, root_certificates=None,
            interceptors=interceptors, retry_invoker=retry_invoker(self.flwr))

    def serve(self, stop: threading.Event) -> None:
        """Claim and run ClientApp tasks until ``stop`` is set. A refused AcquireTask (401: not the
        join's secret) ends the process; any other trouble is logged and the claim tried again."""
        f = self.flwr
        request = f.AcquireTaskRequest(supported_task_types=[str(f.TaskType.CLIENT_APP)])
        while not stop.is_set():
            try:
                res = self.client.AcquireTask(request)
            except Exception as err:  # pylint: disable=broad-exception-caught
                if dropped(err, f):
                    raise
                f.log(WARNING, "warm ClientApp: claiming a task failed (%s); trying again", err)
                stop.wait(1.0)
                continue
            if res.HasField("task") and res.token:
                self.run_task(res.token)
            else:
                stop.wait(self.poll)

    def run_task(self, token: str) -> bool:
        """One message, as ``flwr-clientapp`` runs it, in-process; True when it completed."""
        f = self.flwr
        client = self._client([f.RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                               f.RuntimeTokenHttpInterceptor(token)])
        done, got = run_one(client, f, self.load_client_app)
        self.tasks_done += 1
        ended, stages = time.time(), got.stages
        started = stages["start"]
        pulled, ran = stages.get("pulled", ended), stages.get("ran", ended)
        message = stages.get("message", pulled)
        kind = got.head.metadata.message_type if got.head is not None else "?"
        f.log(INFO, "warm ClientApp: task %d of this process (pid %d) %s %s in %.2f s (input %.2f s, of which the "
              "message %.2f s; ClientApp %.2f s, reply %.2f s)", self.tasks_done, os.getpid(), kind,
              "done" if done else "failed", ended - started, pulled - started, message - started, ran - pulled,
              ended - ran)
        f.log(INFO, "warm ClientApp: stages %s", " ".join(f"{k}={v - started:.2f}" for k, v in stages.items()))
        return done


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Stop when the join that started us is gone (it was killed: nothing may be left running)."""
    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                os._exit(1)  # no orderly exit left to give: the SuperNode is gone too
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def run_preflight(module: str, argument: str) -> int:
    """``module.preflight(argument)`` (the refusal as one line, or None) before any task is claimed:
    said on stdout as `preflight.REFUSED` + the line (exit `EXIT_REFUSED`) or `preflight.PASSED` (0)."""
    refusal = importlib.import_module(module).preflight(argument)
    if refusal is not None:
        print(REFUSED + " ".join(str(refusal).split()), flush=True)
        return EXIT_REFUSED
    print(PASSED, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every ClientApp message of one SuperNode in this process.")
    parser.add_argument("--runtime-api-address", required=True, help="The SuperNode's Runtime API (HOST:PORT).")
    parser.add_argument("--secret-file", default=None, help="The SuperExec auth secret the SuperNode was given.")
    parser.add_argument("--parent-pid", type=int, default=None, help="Exit when this process is gone.")
    parser.add_argument("--preflight", default=None, metavar="MODULE",
                        help="Before claiming any task, run MODULE.preflight(ARG): its refusal ends this process.")
    parser.add_argument("--preflight-arg", default="", metavar="ARG", help="The preflight's argument (JSON).")
    args = parser.parse_args(argv)
    stop = threading.Event()
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid, stop)
    from fedmvp_apps.edge_bundle import switch_off_runtimes

    switch_off_runtimes()  # an edge device's runtimes, as its `edge-client join` was told
    if args.preflight:
        try:
            if run_preflight(args.preflight, args.preflight_arg):
                return EXIT_REFUSED
        except KeyboardInterrupt:  # the join is stopping (its own line)
            return 0
    try:
        secret = open(args.secret_file, "rb").read() if args.secret_file else None
        Executor(args.runtime_api_address, secret).serve(stop)
    except FlowerChanged as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FLOWER_CHANGED
    except KeyboardInterrupt:
        return 0
    except Exception as err:  # noqa: BLE001 - the one refusal `serve` lets through: one line, non-zero
        print(f"error: the SuperNode at {args.runtime_api_address} refused this executor ({err}); was it "
              f"given the same --superexec-auth-secret-file?", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
