"""fedmvp: FedMVP federated multimodal visual prompt tuning for CLIP (training core)."""

__version__ = "0.1.0"
