"""edge-client: runs a fedmvp bundle on a device (ONNX Runtime) and trains its LoRA locally.

Imports neither `fedmvp` nor open_clip; the inference path imports no torch.
"""
