"""fedmvp-export: turns a federated round checkpoint into an edge bundle (ONNX + training artifact)."""
