"""fedmvp_formats, the shared leaf: the PromptFormer digest (one definition for server, exporter and device)."""

from __future__ import annotations

import numpy as np

from fedmvp_formats.promptformer import promptformer_digest


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"promptformer.text_proj.bias": rng.standard_normal(8).astype(np.float32),
            "promptformer.block.attn.to_k.weight": rng.standard_normal((8, 8)).astype(np.float32),
            "lora.block.attn.to_q.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32)}


def test_the_digest_covers_promptformer_names_shapes_and_bytes_only():
    state = _state()
    digest = promptformer_digest(state)
    assert digest == promptformer_digest({k: v for k, v in state.items() if k.startswith("promptformer.")})
    assert digest == promptformer_digest({k: v.astype(np.float64) for k, v in state.items()})  # float32 bytes
    moved = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"] + 1e-3}
    assert promptformer_digest(moved) != digest
    reshaped = {**state, "promptformer.text_proj.bias": state["promptformer.text_proj.bias"].reshape(1, -1)}
    assert promptformer_digest(reshaped) != digest  # the shape is part of it
    renamed = {k.replace("text_proj", "text_proj2"): v for k, v in state.items()}
    assert promptformer_digest(renamed) != digest
