"""Tiny fedmvp run directories for the export and edge-client tests (one copy, both suites)."""

from __future__ import annotations

from pathlib import Path

import torch

def write_run(run_path: Path, preset: Path, pretrained: str, name: str, seed: int = 0,
              lora_rank: int = 4, moved: bool = False,
              lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v"), classes: bool = True) -> None:
    """config.json + rounds 1 and 2; LoRA B perturbed so LoRA changes the outputs.

    Rank 4, not the default 8: every export and edge test then shows the recorded rank travels.
    ``moved``: round 2's PromptFormer and LoRA differ from round 1's, as after a round of training
    (what a bundle refresh moves a device across); config.json then records a ``run_id``.
    ``lora_targets``: the layers the method record puts LoRA on (the exporter must follow it).
    ``classes``: write RUN/classes.json as ``prepare_run`` does, from the preset's federation when there is
    a preset file (False: a run of an older fedmvp)."""
    from fedmvp.model import FedMVP, FedMVPConfig
    from fedmvp.presets.server import ServerSpec
    from fedmvp.runs import RunDir

    method = FedMVPConfig(lora_rank=lora_rank, lora_targets=tuple(lora_targets))
    model = FedMVP.build("fedmvp-tiny", pretrained, method, seed)  # the one rebuild's initial model
    generator = torch.Generator().manual_seed(seed + 1)
    state = model.state("all")
    for name in state:
        if "lora_B" in name:
            state[name] = torch.randn(state[name].shape, generator=generator) * 0.2
    run = RunDir(run_path)
    text = preset.read_text(encoding="utf-8") if preset.is_file() else None  # the record prepare_run keeps
    run.write_config({"preset": name, "preset_path": str(preset), "seed": seed, "rounds": 2,
                      **({"preset_text": text, "preset_dir": str(preset.parent)} if text is not None else {}),
                      "model": {"clip": "fedmvp-tiny", "pretrained": pretrained},
                      "method": method.to_dict(), "server": ServerSpec().record(),
                      **({"run_id": f"moved-run-{seed}"} if moved else {})})
    if classes and text is not None:  # the record prepare_run writes, by the same function
        from fedmvp.run_classes import federation_classes, write_classes

        write_classes(run_path, federation_classes(run.federation()))
    for round_number in (1, 2):
        if moved and round_number == 2:
            state = {k: v + 0.05 * v.std().clamp(min=0.1) * torch.randn(v.shape, generator=generator)
                     for k, v in state.items()}
        run.save_checkpoint(round_number, state, {"lora_clients": [0] if round_number == 2 else [],
                                                  "method": method.to_dict()})


def rebuilt_model(run_path: Path, round_number: int = 2):
    """The PyTorch model as the exporter rebuilds it: the one rebuild (FedMVP.from_run), the run's class set."""
    from export.class_set import run_class_set, text_features
    from fedmvp.model import FedMVP
    from fedmvp.runs import RunDir

    run = RunDir(run_path)
    model = FedMVP.from_run(run, round_number)
    classes = run_class_set(run)
    model.set_text_features(text_features(model.clip_info, classes))
    return model, model.clip_info
