"""Replay devices for the fleet benchmark (docs/benchmarks.md, "Fleets"): many edge devices' ClientApp
in one light process, each behind its own real Flower SuperNode.

A replay device is a real ``flower-supernode`` (the same launch as `edge-client join`:
``fedmvp_apps.deploy.supernode``, node config ``role='edge'``, TLS, its own node key) whose messages
are claimed here, one thread per SuperNode, by the warm executor (``fedmvp_apps.deploy.warm_executor``)
with its ClientApp swapped for ``ReplayApp``: no torch, no bundle, no training. A train message gets
the reply a real device sends (``edge_client.node.train``): the round's LoRA tensors, real-sized (the
ones the message carries), plus a small delta, packed as the device packs them, ``train_metrics`` and
an ``Identity`` of role edge with a bundle id, the round's PromptFormer digest and the run's class-set
digest, after a plausible training time. The server checks it with the same rules
(``fedmvp.federated.replies``): it cannot tell a replay device from a real one.

A device marked to vanish (``vanish_file``) SIGKILLs its own SuperNode when a train message has arrived
once that file exists, and never replies (a device dying mid-update). Every message is one JSON line in ``--events``
(time, node, kind, round, the Flower objects the message and its reply are made of).

    python -m benchmarks.fleet_device --spec devices.json --events events.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DELTA_SCALE = 1e-3  # a replayed update's change to each LoRA value (std): small, like a few local steps
EXAMPLES = 64  # images a replay device says it trained on (8 shots of 8 classes)


@dataclass(frozen=True)
class DeviceSpec:
    """One replay device: its SuperNode's Runtime API and secret, and how it behaves."""

    runtime: str
    secret_file: str
    supernode_pid: int
    bundle_id: str
    train_seconds: tuple[float, float] = (2.0, 6.0)  # uniform training time per update
    vanish_file: str = ""  # once this file exists, SIGKILL its SuperNode on its next train message ("": never)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> "DeviceSpec":
        return cls(**{**row, "train_seconds": tuple(row.get("train_seconds", (2.0, 6.0)))})


def object_count(message: Any) -> int:
    """How many Flower objects a message travels as (``get_all_nested_objects``: the encoding in place)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return len(get_all_nested_objects(message))


class Events:
    """The devices' JSON lines, one file, written whole under a lock."""

    def __init__(self, path: Path):
        self.lock, self.handle = threading.Lock(), open(path, "a", encoding="utf-8")

    def write(self, **row: Any) -> None:
        with self.lock:
            self.handle.write(json.dumps(row) + "\n")
            self.handle.flush()


class ReplayApp:
    """The ClientApp of one replay device: identify, train and evaluate answered as an edge device does."""

    def __init__(self, spec: DeviceSpec, events: Events, stop: threading.Event):
        self.spec, self.events, self.stop = spec, events, stop
        self.trained = 0
        self.rng = np.random.default_rng(abs(hash(spec.bundle_id)) % 2**32)

    def __call__(self, message: Any, context: Any) -> Any:
        from flwr.app import ConfigRecord, Message, RecordDict

        from fedmvp_formats import messages as schema
        from fedmvp_formats.class_set import read_class_set
        from fedmvp_formats.envelope import RECORD, fold, read_envelope
        from fedmvp_formats.messages import Identity, read_instruction

        def content(records: dict[str, dict[str, Any]]) -> Any:  # one ConfigRecord, as edge_client.node sends
            return RecordDict({RECORD: ConfigRecord(fold(records))})

        kind = message.metadata.message_type
        received = read_envelope(message.content, message.content.config_records)
        instruction = read_instruction(received)
        row = {"t": time.time(), "node": int(context.node_id), "kind": kind, "round": instruction.round,
               "objects_in": object_count(message)}
        if kind.startswith("query"):  # identify: an edge device of this run, no bundle yet said
            identity = Identity(round=instruction.round, run_id=instruction.run_id)
            return self._sent(Message(content=content({schema.IDENTITY: identity.record()}), reply_to=message), row)
        digest = read_class_set(instruction.class_set).digest if instruction.class_set else None
        identity = Identity(round=instruction.round, run_id=instruction.run_id, bundle_id=self.spec.bundle_id,
                            promptformer_digest=instruction.promptformer_digest, classes_digest=digest)
        records: dict[str, Any] = {schema.IDENTITY: identity.record()}
        if kind == "train":
            self.trained += 1
            if self.spec.vanish_file and Path(self.spec.vanish_file).exists():
                self._vanish(row)
            records |= self._trained(received, schema)
            records[schema.METRICS] = schema.train_metrics(EXAMPLES, 1.0 + float(self.rng.random()),
                                                           refresh_seconds=0.0)
        else:  # evaluate: the counts a device's held-out share gives
            records[schema.METRICS] = schema.count_metrics({schema.EDGE_SET: (8, 16)})
        return self._sent(Message(content=content(records), reply_to=message), row)

    def _trained(self, received: dict[str, Any], schema: Any) -> dict[str, Any]:
        """The message's LoRA plus a small delta, packed as ``edge_client.node`` packs it, after a training
        time drawn from ``train_seconds``."""
        from fedmvp_formats.names import LORA_PREFIX
        from fedmvp_formats.packed import LAYOUT, packed_records, read_wire

        arrays = read_wire(received.get(schema.ARRAYS), received.get(LAYOUT))
        lora = {k: (v + DELTA_SCALE * self.rng.standard_normal(v.shape)).astype(np.float32)
                for k, v in arrays.items() if k.startswith(LORA_PREFIX)}
        self.stop.wait(random.uniform(*self.spec.train_seconds))
        return packed_records(lora)

    def _sent(self, reply: Any, row: dict[str, Any]) -> Any:
        self.events.write(**row, objects_out=object_count(reply), replied=time.time())
        return reply

    def _vanish(self, row: dict[str, Any]) -> None:
        """Die mid-update: the SuperNode killed outright, this thread never answers."""
        self.events.write(**row, vanished=time.time())
        try:
            os.kill(self.spec.supernode_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.stop.set()
        threading.Event().wait()  # never returns: the device is gone


def serve_device(spec: DeviceSpec, events: Events, stop: threading.Event) -> None:
    """The warm executor's claim loop for one SuperNode, its ClientApp the replay app (no FAB installed)."""
    from fedmvp_apps.deploy.warm_executor import Executor

    executor = Executor(spec.runtime, Path(spec.secret_file).read_bytes())
    executor.flwr.install_from_fab = lambda *args, **kwargs: None  # this namespace only: the app is ours
    app = ReplayApp(spec, events, stop)
    executor.load_client_app = lambda *args: app
    try:
        executor.serve(stop)
    except Exception as err:  # noqa: BLE001 - the SuperNode went away (killed or the run ended)
        events.write(t=time.time(), runtime=spec.runtime, ended=f"{type(err).__name__}: {err}"[:200])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Replay edge devices, one thread per SuperNode.")
    parser.add_argument("--spec", required=True, help="JSON list of DeviceSpec rows.")
    parser.add_argument("--events", required=True, help="Where each message's JSON line goes.")
    args = parser.parse_args(argv)
    specs = [DeviceSpec.from_json(row) for row in json.loads(Path(args.spec).read_text())]
    events, stopped = Events(Path(args.events)), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    threads = [threading.Thread(target=serve_device, args=(spec, events, threading.Event()), daemon=True)
               for spec in specs]
    for thread in threads:
        thread.start()
    while not stopped.wait(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
