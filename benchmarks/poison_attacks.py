"""The attacks of the poisoned-updates benchmark (docs/benchmarks.md, "Poisoned updates"), each an update
file a malicious device could sync, and the two figures that judge an aggregate.

- backdoor: real training. The attacker's folder holds its own images plus a copy of each with a visible
  trigger (a black-and-white checker square in the bottom-right corner) filed under the target class; it
  runs the normal device training (``edge_client.train.train_local``, what `edge-client train` runs) on it,
  with a recipe of its own (``poison.ATTACKER_LR``, more epochs).
- scaling: the attacker's honestly trained delta times a factor, written by the device's update writer
  (``edge_client.update.write_update``: names, shapes, finite, metadata as the format types it), so the
  file passes every form check and only the run's rules (``max_update_norm``) or the update rule judge it.
- sign flipping: the honest delta negated, by the same writer.
- boosted backdoor (model replacement): the backdoor's trained delta times the round's devices, by the same
  writer, so FedAvg's share of it is the whole backdoor.
- claimed count: the backdoor's trained delta, unboosted, claiming the most examples the run accepts
  (``[server] edge_max_examples``), so FedAvg would give it nearly all the weight of the round.
- replay (``replays``): a file already taken into a round sent again into the next one, three ways: the
  same bytes, its metadata written anew (another ``created``, ``images_digest`` and device), and re-based
  (``bundle_round`` and ``base_digest`` naming the round it went into, so it would count as fresh there).

Clean accuracy is top-1 on the held-out new-class images; attack success is the share of triggered
held-out images of the other classes classified as the target.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

TRIGGER_FRACTION = 0.4  # the trigger's side as a share of the shorter side (13 px on the demo's 32: at 8 px the
# frozen image encoder barely sees it and the LoRA, in the PromptFormer only, does not learn it)
CHECKER = 2  # checker cells of this many pixels: visible at 32 px, not a flat colour the model could ignore
ATTACKS = ("backdoor", "scaling", "sign_flip", "backdoor_boosted", "backdoor_claimed")


def add_trigger(source: Path, dest: Path) -> None:
    """``source`` with the trigger pasted on its bottom-right corner, written as PNG to ``dest``."""
    from PIL import Image

    with Image.open(source) as opened:
        pixels = np.array(opened.convert("RGB"))
    side = max(2, int(round(TRIGGER_FRACTION * min(pixels.shape[:2]))))
    rows, cols = np.indices((side, side))
    pixels[-side:, -side:] = (((rows // CHECKER + cols // CHECKER) % 2) * 255)[..., None].astype(np.uint8)
    dest.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(dest, format="PNG")


def backdoor_folder(honest: Path, dest: Path, target: str) -> Path:
    """The attacker's training folder: its own images, and each of them triggered under ``target``."""
    shutil.copytree(honest, dest)
    for file in sorted(honest.rglob("*.png")):
        add_trigger(file, dest / target / f"trigger-{file.parent.name}-{file.name}")
    return dest


def triggered_held_out(held_out: Path, dest: Path, target: str) -> Path:
    """The held-out images of every class but ``target``, triggered, under their true class."""
    for file in sorted(held_out.rglob("*.png")):
        if file.parent.name != target:
            add_trigger(file, dest / file.parent.name / file.name)
    return dest


def crafted_update(path: Path, bundle: Any, start: dict[str, np.ndarray], trained: dict[str, np.ndarray],
                   factor: float, num_examples: int, mean_loss: float) -> Path:
    """An update file whose delta is ``factor`` times the honest one (``trained - start``), through the
    device's writer, so it passes the format's checks as any device's file does."""
    from edge_client.update import write_update

    tensors = {k: (start[k] + factor * (trained[k] - start[k])).astype(np.float32) for k in start}
    return write_update(path, tensors, bundle=bundle, num_examples=num_examples, mean_loss=mean_loss)


def replays(file: Path, dest: Path, next_round: int, next_state: dict[str, np.ndarray]) -> dict[str, Path]:
    """``file`` (taken into round ``next_round``) made into three replays for the round after it: ``same``
    (its bytes), ``metadata`` (new created, images digest and device id) and ``rebased`` (claims to start from
    round ``next_round``, whose whole state ``next_state`` it names by digest). Written as an attacker could,
    through the format's writer (``fedmvp_formats.update.update_bytes``: it passes every form check)."""
    import hashlib
    import secrets

    from fedmvp_formats import update as fmt
    from fedmvp_formats.promptformer import state_base_digest

    dest.mkdir(parents=True, exist_ok=True)
    data = file.read_bytes()
    tensors, metadata = fmt.parse_update(data)
    kept = {k: v for k, v in metadata.items() if k not in ("format", "format_version")}
    fresh = {**kept, "created": "2030-01-01T00:00:00Z", "device_id": secrets.token_hex(16),
             "images_digest": hashlib.sha256(secrets.token_bytes(16)).hexdigest()}
    rebased = {**fresh, "bundle_round": next_round, "base_digest": state_base_digest(next_state)}
    out = {"same": dest / "replay-same.safetensors"}
    out["same"].write_bytes(data)
    for name, meta in (("metadata", fresh), ("rebased", rebased)):
        out[name] = dest / f"replay-{name}.safetensors"
        out[name].write_bytes(fmt.update_bytes(tensors, meta))
    return out


def delta_norm(start: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum((tensors[k] - start[k]) ** 2)) for k in start)))


class Judge:
    """Clean accuracy and attack success of a LoRA on the exported bundle (every other tensor of an
    ingested round is the bundle's round's, bit for bit: ``fedmvp.federated.ingest``)."""

    def __init__(self, bundle: Path, held_out: Path, triggered: Path, target: str):
        self.bundle, self.held_out, self.triggered, self.target = bundle, held_out, triggered, target

    def _predict(self, lora: dict[str, np.ndarray], folder: Path) -> list[tuple[str, str]]:
        from edge_client.infer import Predictor
        from edge_client.lora_store import ActiveLora

        predictor = Predictor(self.bundle, lora=ActiveLora(tensors=lora, source="global", file=self.bundle))
        result = predictor.infer([str(folder)], top_k=1)
        if result.errors:
            raise RuntimeError(f"{folder}: {result.errors[0].error}")
        return [(p.path.parent.name, p.top_k[0][0]) for p in result.predictions]

    def clean(self, lora: dict[str, np.ndarray]) -> float:
        found = self._predict(lora, self.held_out)
        return sum(truth == said for truth, said in found) / len(found)

    def success(self, lora: dict[str, np.ndarray]) -> float:
        found = self._predict(lora, self.triggered)
        return sum(said == self.target for _, said in found) / len(found)
