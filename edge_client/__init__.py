"""edge-client: runs a fedmvp bundle on a device (ONNX Runtime) and trains its LoRA locally.

Inference (no torch): ``bundle`` (the format, `Bundle`: identity, round, method config),
``infer``, ``runtime``, ``preprocess``, ``images``, ``lora_store`` (which LoRA runs,
rollback), ``update`` (the update file), ``atomic`` (every file write).
Training (torch, imported lazily): ``train`` (the loop), ``train_options`` (`TrainOptions`),
``local_data``, ``batch_fit``, ``program``. Imports neither `fedmvp` nor open_clip.
"""
