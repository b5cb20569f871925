"""The SuperExec process of `fedmvp serve`: Flower's own ``flower-superexec``, except how it starts
the ServerApp.

Flower 1.42's SuperExec (``SubprocessExecutor.launch``) starts each task as ``flwr-serverapp
--runtime-api-address ADDR --token TOKEN``: the run's Runtime API token on a command line, which
every local user reads in ``ps`` (``/proc/PID/cmdline``) and can replay against the Runtime API for
as long as the run lasts (docs/security.md, the row of another local user). This entry point gives the
SuperExec an executor that starts `fedmvp_apps.deploy.serverapp_process` instead and hands it the
token on a pipe (its standard input, which only this process holds): nothing secret on a command
line or in an environment. Only the ServerApp task type is claimed (all a SuperLink's SuperExec
runs); its output is discarded as Flower's own launch discards it (``flwr log`` keeps the
ServerApp's log).

``python -m fedmvp_apps.deploy.superexec_process ARGS`` takes exactly ``flower-superexec``'s
arguments. Where the Flower found no longer selects its executor through
``run_superexec.get_executor``, it refuses to start (exit 2, one line) rather than fall back to a
launch that shows the token. Imports neither ``fedmvp`` nor torch.
"""

from __future__ import annotations

import subprocess
import sys

SERVERAPP_MODULE = "fedmvp_apps.deploy.serverapp_process"


def serverapp_command(spec) -> list[str]:
    """The ServerApp's command line: everything of ``spec`` but its token (that goes on stdin)."""
    args = [sys.executable, "-m", SERVERAPP_MODULE, "--runtime-api-address", spec.runtime_api_address,
            "--token-stdin"]
    if spec.insecure:
        args.append("--insecure")
    elif spec.root_certificates_path is not None:
        args += ["--root-certificates", spec.root_certificates_path]
    if spec.parent_pid is not None:
        args += ["--parent-pid", str(spec.parent_pid)]
    if spec.runtime_dependency_install:
        args.append("--allow-runtime-dependency-installation")
    return args


def token_on_stdin_executor():
    """Flower's subprocess executor, launching the ServerApp with its token on a pipe."""
    from flwr.supercore.constant import TaskType
    from flwr.supercore.superexec.executor import LaunchResult
    from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

    class TokenOnStdinExecutor(SubprocessExecutor):
        def get_eligible_capacity(self, supported_task_types, **kwargs):
            return {TaskType.SERVER_APP} & set(supported_task_types), set()

        def launch(self, spec):
            if spec.task_type != TaskType.SERVER_APP:
                return LaunchResult.failed(f"this SuperExec runs ServerApp tasks only, not {spec.task_type}")
            quiet = subprocess.DEVNULL if spec.suppress_output else None
            proc = subprocess.Popen(serverapp_command(spec), stdin=subprocess.PIPE, stdout=quiet,  # noqa: S603
                                    stderr=quiet)
            try:
                proc.stdin.write(spec.token.encode("ascii") + b"\n")  # 257 bytes: within any pipe's buffer
                proc.stdin.close()
            except OSError as err:  # it died at start: the SuperLink's task expiry handles the task
                return LaunchResult.failed(f"the ServerApp process did not take its token ({err})")
            return LaunchResult.accepted()

    return TokenOnStdinExecutor()


def main() -> None:
    import importlib

    runner = importlib.import_module("flwr.supercore.superexec.run_superexec")
    from flwr.supercore.constant import ExecutorType

    flower_get_executor = getattr(runner, "get_executor", None)
    if not callable(flower_get_executor):
        print("fedmvp superexec: this Flower does not choose its executor through run_superexec.get_executor; "
              "refusing to start a ServerApp with its token on the command line (pin flwr==1.42.*)",
              file=sys.stderr)
        sys.exit(2)

    def get_executor(executor_type, *args, **kwargs):
        if executor_type == ExecutorType.SUBPROCESS:
            return token_on_stdin_executor()
        return flower_get_executor(executor_type, *args, **kwargs)

    runner.get_executor = get_executor
    from flwr.supercore.cli import flower_superexec

    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
