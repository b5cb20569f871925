"""edge-client: runs a fedmvp bundle on a device (ONNX Runtime) and trains its LoRA locally.

Inference (no torch): ``bundle`` (the format, `Bundle`: identity, round, method config),
``infer``, ``runtime``, ``preprocess``, ``images``, ``lora_store`` (which LoRA runs,
rollback), ``update`` (the update file); every file write is ``fedmvp_formats.atomic``'s.
Training (torch, imported lazily): ``train`` (the loop), ``train_options`` (`TrainOptions`),
``local_data``, ``batch_fit``, ``program``. Imports neither `fedmvp` nor open_clip, and reads no
environment variable: the device commands (``fedmvp_apps.edge_cli``) read theirs and pass the values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedmvp_formats.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers (and the import-graph test) see; at run time see __getattr__
    from edge_client.bundle import Bundle, BundleError, read_bundle
    from edge_client.infer import InferResult, Prediction, Predictor, infer_paths
    from edge_client.lora_store import ActiveLora, apply_update, rollback
    from edge_client.train import TrainResult, train_local
    from edge_client.train_options import TrainingError, TrainInputError, TrainOptions
    from edge_client.update import Update, UpdateError, read_update, write_update

_HOMES = {
    # inference and personalisation: numpy and ONNX Runtime, never torch
    "Bundle": "edge_client.bundle", "BundleError": "edge_client.bundle", "read_bundle": "edge_client.bundle",
    "infer_paths": "edge_client.infer", "Predictor": "edge_client.infer", "Prediction": "edge_client.infer",
    "InferResult": "edge_client.infer",
    "apply_update": "edge_client.lora_store", "rollback": "edge_client.lora_store",
    "ActiveLora": "edge_client.lora_store",
    "read_update": "edge_client.update", "write_update": "edge_client.update", "Update": "edge_client.update",
    "UpdateError": "edge_client.update",
    # training: `train_local` imports torch when called, not when imported
    "train_local": "edge_client.train", "TrainResult": "edge_client.train",
    "TrainOptions": "edge_client.train_options", "TrainingError": "edge_client.train_options",
    "TrainInputError": "edge_client.train_options",
}
__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
