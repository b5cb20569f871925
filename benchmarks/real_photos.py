"""Site folders of real photographs, offline: crops of the photos scikit-image ships in its wheel.

Why: the tutorials' stand-in is the tiny CLIP's own synthetic world, where it is already near perfect;
a user's photos are not. This cuts ``--per-class`` crops of each of a few real photographs (scikit-image's
``skimage/data`` files, read from the installed package: no download, no pooch) into the site layout
every ``[federation]`` site brings, ``OUT/<site>/<class>/<image>.png`` (docs/howto/datasets.md), each
site its own crops, and writes a hand-written attribute file for the classes (``OUT/attributes.json``,
ten phrases each: docs/howto/attributes.md allows a file written by hand). Nothing in fedmvp needs it
at runtime; it needs ``scikit-image`` (the ``dev`` extra) and Pillow.

    python -m benchmarks photos --out photos                       # sites north and south, 12 crops
    python -m benchmarks photos --out photos --sites a b c --per-class 20 --classes cat rocket coffee

Measured on it (docs/tutorials/one-machine.md): ``fedmvp-tiny`` cannot tell these classes apart by
text (fedmvp/vocabulary_check.py warns), so its figures sit at chance; a real CLIP is the fix
(docs/howto/weights.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import random
import sys
from pathlib import Path

from PIL import Image

from fedmvp_formats.atomic import write_bytes, write_json

# class -> (file in skimage/data, ten visual phrases written by hand)
PHOTOS: dict[str, tuple[str, list[str]]] = {
    "astronaut": ("astronaut.png", [
        "a white spacesuit", "an American flag patch", "a smiling face", "short brown hair",
        "a space shuttle model", "a dark blue background", "shoulder patches", "a person in uniform",
        "a portrait framing", "a bright studio light"]),
    "coffee": ("coffee.png", [
        "a white ceramic cup", "a saucer", "dark brown liquid", "a light foam swirl", "a silver spoon",
        "a red tablecloth", "a round rim", "a cup handle", "a close view from above", "a warm drink"]),
    "cat": ("chelsea.png", [
        "orange tabby fur", "striped markings", "pointed ears", "long white whiskers", "green eyes",
        "a pink nose", "a furry face", "a small animal", "soft fur texture", "a blurred background"]),
    "rocket": ("rocket.jpg", [
        "a tall white rocket", "a launch tower", "a blue sky", "exhaust smoke", "a pointed nose cone",
        "booster engines", "a launch pad", "metal girders", "bright flames", "a vertical shape"]),
    "motorcycle": ("motorcycle_left.png", [
        "a black motorcycle", "two wheels", "chrome parts", "a leather seat", "handlebars",
        "an engine block", "spoked wheels", "a garage floor", "a fuel tank", "a side view of a vehicle"]),
    "galaxy": ("hubble_deep_field.jpg", [
        "a black night sky", "many small bright dots", "spiral galaxies", "distant stars",
        "orange and blue specks", "a deep space view", "faint fuzzy shapes", "a telescope image",
        "scattered points of light", "a dark background"]),
    "coins": ("coins.png", [
        "round metal coins", "a grey image", "embossed faces", "rows of discs", "a dark background",
        "shiny rims", "old currency", "circular outlines", "engraved patterns", "small flat objects"]),
    "brick": ("brick.png", [
        "a brick wall", "rectangular blocks", "mortar lines", "a grey image", "a rough surface",
        "a repeating pattern", "horizontal rows", "a flat wall", "worn stone texture", "straight edges"]),
}

CROP_SIZE = 96  # pixels written per crop; the backbone resizes to its own input size


def photo_folder() -> Path:
    """``skimage/data`` inside the installed wheel, found without importing scikit-image (fast)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("real_photos: scikit-image is not installed (pip install scikit-image, or .[dev])")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def crops(photo: Image.Image, count: int, rng: random.Random) -> list[Image.Image]:
    """``count`` random square crops, each 35-70% of the photo's short side, resized to CROP_SIZE."""
    width, height = photo.size
    out = []
    for _ in range(count):
        side = int(min(width, height) * rng.uniform(0.35, 0.7))
        left, top = rng.randint(0, width - side), rng.randint(0, height - side)
        crop = photo.crop((left, top, left + side, top + side)).resize((CROP_SIZE, CROP_SIZE), Image.BICUBIC)
        out.append(crop.transpose(Image.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else crop)
    return out


def write_png(image: Image.Image, path: Path) -> None:
    """Atomic (fedmvp_formats.atomic), so a killed run leaves no half image in a site folder."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    write_bytes(path, buffer.getvalue())


def make_sites(out: str | os.PathLike, sites: list[str], classes: list[str], per_class: int,
               seed: int = 0) -> dict[str, list[str]]:
    """Write ``out/<site>/<class>/NNN.png`` and ``out/attributes.json``; return {site: classes}."""
    unknown = [c for c in classes if c not in PHOTOS]
    if unknown:
        raise SystemExit(f"real_photos: unknown class {unknown[0]!r}; known: {', '.join(PHOTOS)}")
    folder, root = photo_folder(), Path(out)
    missing = [PHOTOS[c][0] for c in classes if not (folder / PHOTOS[c][0]).is_file()]
    if missing:
        raise SystemExit(f"real_photos: {missing[0]} is not in this scikit-image wheel ({folder})")
    photos = {name: Image.open(folder / PHOTOS[name][0]).convert("RGB") for name in classes}  # decoded once
    for index, site in enumerate(sites):
        for label, name in enumerate(classes):
            rng = random.Random(seed * 1_000_003 + index * 1009 + label)  # each site its own crops
            photo = photos[name]
            target = root / site / name
            target.mkdir(parents=True, exist_ok=True)
            for number, crop in enumerate(crops(photo, per_class, rng)):
                write_png(crop, target / f"{number:03d}.png")
    write_json(root / "attributes.json", {name: PHOTOS[name][1] for name in classes})
    return {site: list(classes) for site in sites}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the sites and attributes.json into")
    parser.add_argument("--sites", nargs="+", default=["north", "south"])
    parser.add_argument("--classes", nargs="+", default=list(PHOTOS), help=f"of: {' '.join(PHOTOS)}")
    parser.add_argument("--per-class", type=int, default=12, help="crops per class and site")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.per_class < 1:
        parser.error("--per-class must be at least 1")
    made = make_sites(args.out, args.sites, args.classes, args.per_class, args.seed)
    for site, names in made.items():
        print(f"{Path(args.out) / site}: {len(names)} classes x {args.per_class} crops")
    print(f"{Path(args.out) / 'attributes.json'}: {len(args.classes)} classes, 10 phrases each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
