"""Tiny fedmvp run directories for the export and edge-client tests (one copy, both suites)."""

from __future__ import annotations

from pathlib import Path

import torch

def write_run(run_path: Path, preset: Path, pretrained: str, name: str, seed: int = 0,
              lora_rank: int = 4, moved: bool = False,
              lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v")) -> None:
    """config.json + rounds 1 and 2; LoRA B perturbed so LoRA changes the outputs.

    Rank 4, not the default 8: every export and edge test then shows the recorded rank travels.
    ``moved``: round 2's PromptFormer and LoRA differ from round 1's, as after a round of training
    (what a bundle refresh moves a device across); config.json then records a ``run_id``.
    ``lora_targets``: the layers the method record puts LoRA on (the exporter must follow it)."""
    from fedmvp.clip import load_clip
    from fedmvp.model import FedMVP, FedMVPConfig
    from fedmvp.runs import RunDir

    torch.manual_seed(seed)
    clip = load_clip("fedmvp-tiny", pretrained or None)
    method = FedMVPConfig(lora_rank=lora_rank, lora_targets=tuple(lora_targets))
    model = FedMVP(clip, method)
    generator = torch.Generator().manual_seed(seed + 1)
    state = model.state("all")
    for name in state:
        if "lora_B" in name:
            state[name] = torch.randn(state[name].shape, generator=generator) * 0.2
    run = RunDir(run_path)
    run.write_config({"preset": name, "preset_path": str(preset), "seed": seed, "rounds": 2,
                      "model": {"clip": "fedmvp-tiny", "pretrained": pretrained},
                      "method": method.to_dict(), **({"run_id": f"moved-run-{seed}"} if moved else {})})
    for round_number in (1, 2):
        if moved and round_number == 2:
            state = {k: v + 0.05 * v.std().clamp(min=0.1) * torch.randn(v.shape, generator=generator)
                     for k, v in state.items()}
        run.save_checkpoint(round_number, state, {"lora_clients": [0] if round_number == 2 else [],
                                                  "method": method.to_dict()})


def rebuilt_model(run_path: Path, round_number: int = 2):
    """The PyTorch model exactly as the exporter rebuilds it (same seed, tensors, class set)."""
    from export.class_set import run_class_set, text_features
    from export.run_inputs import load_checkpoint, method_config, read_config, rebuild_model, run_federation
    from fedmvp.clip import load_clip
    from fedmvp.runs import RunDir

    run = RunDir(run_path)
    config = read_config(run)
    checkpoint = load_checkpoint(run, round_number)
    classes = run_class_set(run_federation(config, run), "run")
    torch.manual_seed(int(config["seed"]))
    clip = load_clip("fedmvp-tiny", config["model"]["pretrained"] or None)
    model = rebuild_model(clip, method_config(run, checkpoint), checkpoint, run.path)
    model.set_text_features(text_features(clip, classes))
    return model, clip
