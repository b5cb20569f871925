"""The warm ClientApp executor: one long-lived process runs every message its SuperNode receives.

Flower's default (``flower-supernode --isolation subprocess``) starts a fresh ``flwr-clientapp``
process per message, so a site imports torch, loads CLIP and rebuilds its data index every round
(issue 24: ~18 s a steady round on the demo preset). With ``--isolation process`` the SuperNode
starts nothing itself: an executor claims each pending task on the SuperNode's Runtime API and
runs it. This module is that executor, in ONE process: it claims tasks as Flower's SuperExec does
(``AcquireTask``, ClientApp tasks only) and runs each as ``flwr-clientapp`` does (the same Flower
functions: pull the task input, install the FAB, load the ClientApp, push the reply and the task
output), but in-process, so module-level caches (a site's ``fedmvp.federated.task.task_context``,
an edge device's bundle session) survive between messages: Flower issue #3670, the long-running
ClientApp of PR #4039. Flower's loader reuses an imported module (``sys.modules``), so the
ClientApp object and its caches are loaded once.

What this uses of Flower that is not its CLI lives in ``_flower()``, one place: a Flower that
moved a name fails there with one line naming it. Imports neither ``fedmvp`` nor torch (an edge
install runs it: docs/architecture.md "Layers").
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from types import SimpleNamespace
from typing import Any

# The SuperExec auth (HMAC) guards AcquireTask: only the holder of the join's secret claims tasks.
PROTECTED_METHODS = ("/flwr.proto.Runtime/AcquireTask",)
POLL_SECONDS = 0.2  # between two AcquireTask calls while idle (Flower's SuperExec: 1 s)
EXIT_FLOWER_CHANGED = 3


class FlowerChanged(RuntimeError):
    """This Flower lacks a function the warm executor uses (written against flwr 1.42)."""


def _flower() -> SimpleNamespace:
    """Every Flower name the executor uses, imported in one place (a changed Flower: one line)."""
    try:
        from flwr.app import Message
        from flwr.app.error import Error
        from flwr.cli.install import install_from_fab
        from flwr.clientapp.client_app import LoadClientAppError
        from flwr.clientapp.utils import get_load_client_app_fn
        from flwr.common.constant import ErrorCode, SubStatus
        from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
        from flwr.supercore import log
        from flwr.supercore.constant import TaskType
        from flwr.supercore.heartbeat import HeartbeatSender
        from flwr.supercore.interceptors import (
            RuntimeTokenHttpInterceptor,
            RuntimeVersionHttpInterceptor,
            SuperExecAuthHttpInterceptor,
        )
        from flwr.supercore.retry import make_simple_http_retry_invoker
        from flwr.supercore.runtime import RuntimeHttpClient
        from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output
    except ImportError as err:
        import flwr

        raise FlowerChanged(f"the warm ClientApp executor needs flwr 1.42's runtime API, this flwr "
                            f"{getattr(flwr, '__version__', '?')} lacks it ({err})") from None
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "err"})


@dataclass
class Executor:
    """Claims the SuperNode's ClientApp tasks and runs each in this process."""

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
            interceptors=interceptors, retry_invoker=self.flwr.make_simple_http_retry_invoker())

    def serve(self, stop: threading.Event) -> None:
        """Claim and run ClientApp tasks until ``stop`` is set."""
        request = self.flwr.AcquireTaskRequest(supported_task_types=[str(self.flwr.TaskType.CLIENT_APP)])
        while not stop.is_set():
            res = self.client.AcquireTask(request)
            if res.HasField("task") and res.token:
                self.run_task(res.token)
            else:
                stop.wait(self.poll)

    def run_task(self, token: str) -> bool:
        """One message, as ``flwr-clientapp`` runs it (flwr/supernode/runtime/run_clientapp.py), in-process."""
        f = self.flwr
        client = self._client([f.RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                               f.RuntimeTokenHttpInterceptor(token)])
        heartbeat = f.HeartbeatSender(_heartbeat_fn(client, f))
        message = context = reply = None
        sub_status, details, started = f.SubStatus.FAILED, "ClientApp task failed due to unknown reason", time.time()
        stages = {"pulled": started, "ran": started}
        try:
            heartbeat.start()
            message, context, run, fab = f.pull_task_input(client)
            f.install_from_fab(fab.content, skip_prompt=True)
            client_app = self.load_client_app(run.fab_id, run.fab_version, fab.hash_str)
            stages["pulled"] = time.time()
            reply = client_app(message=message, context=context)
            stages["ran"] = time.time()
            sub_status, details = f.SubStatus.COMPLETED, ""
        except Exception as ex:  # pylint: disable=broad-exception-caught  # a failed message, not a dead node
            code = f.ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(ex, f.LoadClientAppError) \
                else f.ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            details = f"{type(ex)}:<'{ex}'>"
            f.log(ERROR, "ClientApp raised an exception", exc_info=ex)
            if message is not None:
                reply = f.Message(f.Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    f.push_message(client, reply, context)
            except Exception as ex:  # pylint: disable=broad-exception-caught
                f.log(ERROR, "Failed to push reply message", exc_info=ex)
                sub_status = f.SubStatus.FAILED
            f.push_task_output(client=client, context=context, sub_status=sub_status, details=details)
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()
        self.tasks_done += 1
        ended = time.time()
        f.log(INFO, "warm ClientApp: task %d of this process (pid %d) %s in %.2f s (input %.2f s, ClientApp %.2f s, "
              "reply %.2f s)", self.tasks_done, os.getpid(), "done" if sub_status == f.SubStatus.COMPLETED else "failed",
              ended - started, stages["pulled"] - started, stages["ran"] - stages["pulled"], ended - stages["ran"])
        return sub_status == f.SubStatus.COMPLETED


def _heartbeat_fn(client, f: SimpleNamespace):
    """Flower's task heartbeat, except that a refused one is logged, not a SIGINT to the process
    (``make_task_heartbeat_fn_http`` interrupts ``flwr-clientapp``; here it would end every later task)."""
    request = f.SendTaskHeartbeatRequest()
    warned = []

    def beat() -> bool:
        try:
            ok = client.SendTaskHeartbeat(request).success
        except Exception:  # pylint: disable=broad-exception-caught  # transport trouble: Flower retries
            return False
        if not ok and not warned:
            warned.append(True)
            f.log(WARNING, "warm ClientApp: the SuperNode no longer knows this task (timed out?)")
        return True

    return beat


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Stop when the join that started us is gone (it was killed: nothing may be left running)."""
    def watch() -> None:
        while not stop.wait(1.0):
            if os.getppid() != parent_pid:
                os._exit(1)  # no orderly exit left to give: the SuperNode is gone too
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every ClientApp message of one SuperNode in this process.")
    parser.add_argument("--runtime-api-address", required=True, help="The SuperNode's Runtime API (HOST:PORT).")
    parser.add_argument("--secret-file", default=None, help="The SuperExec auth secret the SuperNode was given.")
    parser.add_argument("--parent-pid", type=int, default=None, help="Exit when this process is gone.")
    args = parser.parse_args(argv)
    stop = threading.Event()
    if args.parent_pid is not None:
        _watch_parent(args.parent_pid, stop)
    try:
        secret = open(args.secret_file, "rb").read() if args.secret_file else None
        Executor(args.runtime_api_address, secret).serve(stop)
    except FlowerChanged as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FLOWER_CHANGED
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
