"""Writing the synthetic world to disk as ImageFolder trees, and the cached default world.

Why on disk: every loader (and the edge client) should read the embedded world exactly like
user data. Layout::

    ROOT/<domain>/<split>/<class>/<nnnn>.png   each ROOT/<domain>/<split> is an ImageFolder
    ROOT/attributes.json                        {class: [10 phrases]} plus "_meta" (loaders skip it)
    ROOT/world.json                             seed, domains, splits, per class: description,
                                                attribute values, label, held_out

ImageFolder sorts class folders alphabetically; the label order is world.json's (seen first).
The tree is written into ``ROOT.tmp-*`` and renamed at the end, so an interrupted run never
leaves a half tree that looks complete. Each image has its own seed stream keyed by
(seed, domain, split, class, index), so a subset of the tree has the same bytes as the full one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

from fedmvp_formats.atomic import replace_dir
from fedmvp_formats.files import cache_root

from fedmvp.synthetic.render import IMAGE_SIZE, image_rng, render
from fedmvp.synthetic.world import DOMAINS, K_PHRASES, SPLITS, attributes_dict, load_classes

WORLD_VERSION = 3  # bump when rendering or the class list changes: cached worlds are then rebuilt
DEFAULT_COUNTS: dict[str, int] = {"train": 16, "val": 8, "test": 16}  # images per class, domain and split


def default_cache_root() -> Path:
    return cache_root()


def world_metadata(seed: int, counts: dict[str, int], domains: Iterable[str]) -> dict:
    classes = load_classes()
    return {
        "version": WORLD_VERSION,
        "seed": seed,
        "image_size": IMAGE_SIZE,
        "layout": "<domain>/<split>/<class>/<nnnn>.png",
        "domains": list(domains),
        "splits": {s: counts[s] for s in SPLITS if s in counts},
        "attributes": "attributes.json",
        "classes": [{"label": i, "name": c.name, "description": c.description, **c.values(),
                     "held_out": c.held_out} for i, c in enumerate(classes)],
        "seen": [c.name for c in classes if not c.held_out],
        "held_out": [c.name for c in classes if c.held_out],
    }


def attributes_file(seed: int) -> dict:
    meta = {"doc": "Attribute phrases per class in the LLM format {class: [10 phrases]}; "
                   "keys are folder names; '_meta' is not a class.",
            "k": K_PHRASES, "world_version": WORLD_VERSION, "seed": seed}
    return {"_meta": meta, **attributes_dict()}


def _render_jobs(root: Path, seed: int, counts: dict[str, int], domains: Iterable[str]):
    classes = load_classes()
    for domain in domains:
        d_i = DOMAINS.index(domain)
        for split, count in counts.items():
            s_i = SPLITS.index(split)
            for c_i, cls in enumerate(classes):
                folder = root / domain / split / cls.name
                for n in range(count):
                    yield folder / f"{n:04d}.png", (seed, d_i, s_i, c_i, n), cls, domain


def _render_chunk(jobs: list) -> int:
    for path, key, cls, domain in jobs:
        render(cls, domain, image_rng(*key)).save(path, format="PNG")
    return len(jobs)


def write_world(out: str | Path, seed: int = 0, counts: dict[str, int] | None = None,
                domains: Iterable[str] = DOMAINS, progress: bool = False, workers: int | None = None) -> Path:
    """Render the world into ``out`` (which must not exist yet) and return it.

    ``workers``: processes rendering in parallel (default 2); the bytes do not depend on it."""
    out = Path(out)
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    domains = list(domains)
    bad = [d for d in domains if d not in DOMAINS] + [s for s in counts if s not in SPLITS]
    if bad:
        raise ValueError(f"unknown domains/splits: {', '.join(bad)}")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        jobs = list(_render_jobs(tmp, seed, counts, domains))
        for folder in {path.parent for path, *_ in jobs}:
            folder.mkdir(parents=True, exist_ok=True)
        chunks = [jobs[i:i + 64] for i in range(0, len(jobs), 64)]
        workers = max(1, min(workers if workers is not None else 2, os.cpu_count() or 1, len(chunks)))
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="rendering world", unit="img")
        if workers == 1:
            done: Iterable[int] = map(_render_chunk, chunks)
        else:
            pool = multiprocessing.get_context("fork" if os.name == "posix" else "spawn").Pool(workers)
            done = pool.imap_unordered(_render_chunk, chunks)
        try:
            for n in done:
                if bar is not None:
                    bar.update(n)
        finally:
            if workers > 1:
                pool.terminate()
            if bar is not None:
                bar.close()
        (tmp / "attributes.json").write_text(json.dumps(attributes_file(seed), indent=2) + "\n")
        (tmp / "world.json").write_text(json.dumps(world_metadata(seed, counts, domains), indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the world is ordinary shared data
        for meta in ("attributes.json", "world.json"):
            (tmp / meta).chmod(0o644)
        replace_dir(tmp, out)  # an existing out is empty (checked above)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_world(root: str | Path) -> dict:
    """world.json of a written world."""
    return json.loads((Path(root) / "world.json").read_text())


def is_complete(root: Path, seed: int, counts: dict[str, int], domains: Iterable[str]) -> bool:
    try:
        meta = read_world(root)
    except (OSError, ValueError):
        return False
    return (meta.get("version") == WORLD_VERSION and meta.get("seed") == seed
            and all(meta["splits"].get(s) == n for s, n in counts.items())
            and set(domains) <= set(meta["domains"]))


def ensure_world(root: str | Path | None = None, seed: int = 0, counts: dict[str, int] | None = None,
                 domains: Iterable[str] = DOMAINS, progress: bool = False, workers: int | None = None) -> Path:
    """The world at ``root`` (default: ``$FEDMVP_CACHE/world-<seed>-v<version>``), generated if absent.

    Safe when several processes race: each writes its own temp tree, the first rename wins."""
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    domains = list(domains)
    if root is None:
        suffix = "" if counts == DEFAULT_COUNTS else "-" + "-".join(f"{s}{n}" for s, n in counts.items())
        suffix += "" if domains == list(DOMAINS) else "-" + "-".join(domains)
        root = default_cache_root() / f"world-{seed}-v{WORLD_VERSION}{suffix}"
    root = Path(root)
    if is_complete(root, seed, counts, domains):
        return root
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} holds something other than world seed {seed} v{WORLD_VERSION} "
                              f"with {counts}; remove it or pick another root")
    try:
        return write_world(root, seed, counts, domains, progress=progress, workers=workers)
    except OSError:
        if is_complete(root, seed, counts, domains):  # another process finished first
            return root
        raise
