"""Site folders cut from a synthetic world: each site holds only its own classes (issue 24)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def site_preset(folder: Path, world: Path, sites: dict[str, list[str]], new: list[str], rounds: int = 2,
                extra: str = "", listed: bool = True) -> Path:
    """A [federation] preset over ``world``'s classes named in ``sites`` (+ ``new``), one folder per site
    (``folder/sites/<name>/<class>/``: the world's photo train and test images of that class). ``listed``
    False: no [[sites]] (open membership: the sites join by name, the server numbers them)."""
    attrs = json.loads((world / "attributes.json").read_text())
    classes = [c for names in sites.values() for c in names if c not in new] + new
    (folder / "attributes.json").write_text(json.dumps({c: attrs[c] for c in dict.fromkeys(classes)}))
    lines = ['name = "clinics"', "seed = 3", "[model]", 'clip = "fedmvp-tiny"', 'pretrained = ""', "[train]",
             f"rounds = {rounds}", "local_epochs = 1", "batch_size = 4", "lora_rank = 4", extra,
             "[federation]", 'attributes = "attributes.json"', f"new_classes = {json.dumps(new)}"]
    for name, names in sites.items():
        for c in names:
            for split in ("train", "test"):
                for image in sorted((world / "photo" / split / c).iterdir()):
                    target = folder / "sites" / name / c / f"{split}-{image.name}"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(image, target)
        if listed:
            lines += ["[[sites]]", f'name = "{name}"', f'data = "sites/{name}"']
    path = folder / "clinics.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def world_classes(world: Path) -> tuple[list[str], list[str]]:
    """(seen, held-out) class names of a written world."""
    meta = json.loads((world / "world.json").read_text())
    return ([c["name"] for c in meta["classes"] if not c.get("held_out")],
            [c["name"] for c in meta["classes"] if c.get("held_out")])
