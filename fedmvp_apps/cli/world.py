"""`fedmvp world`: write the synthetic attribute world as ImageFolder trees."""

from __future__ import annotations

from pathlib import Path

import click

from fedmvp_apps.cli.common import BadInput, emit_json


@click.command()
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder to write (must not exist or be empty). Default: the cached world "
                   "($FEDMVP_CACHE or ~/.cache/fedmvp)/world-<seed>-v<version>, reused if already there.")
@click.option("--seed", default=0, show_default=True, type=int, help="World seed: same seed, same bytes.")
@click.option("--train", "n_train", default=16, show_default=True, type=click.IntRange(min=0),
              help="Training images per class and domain.")
@click.option("--val", "n_val", default=8, show_default=True, type=click.IntRange(min=0),
              help="Validation images per class and domain.")
@click.option("--test", "n_test", default=16, show_default=True, type=click.IntRange(min=0),
              help="Test images per class and domain.")
@click.option("--domains", default="photo,sketch,painting", show_default=True,
              help="Comma-separated visual domains to render.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1),
              help="Rendering processes (the images do not depend on it).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def world(out: Path | None, seed: int, n_train: int, n_val: int, n_test: int, domains: str, workers: int,
          as_json: bool) -> None:
    """Render the embedded synthetic world: objects defined by shape, colour, surface
    pattern and size, 64 named classes (48 seen in the tiny CLIP's pretraining, 16 held
    out), in photo, sketch and painting domains.

    Writes OUT/<domain>/<split>/<class>/<nnnn>.png (each OUT/<domain>/<split> is an
    ImageFolder), OUT/attributes.json ({class: [10 phrases]}) and OUT/world.json."""
    from fedmvp.synthetic.world import DOMAINS
    from fedmvp.atomic import os_error_line, probe_writable
    from fedmvp.synthetic.writer import default_cache_root, ensure_world, read_world, write_world

    picked = [d.strip() for d in domains.split(",") if d.strip()]
    unknown = [d for d in picked if d not in DOMAINS]
    if unknown or not picked:
        raise BadInput(f"unknown domain(s) {', '.join(unknown) or '(none)'}; known: {', '.join(DOMAINS)}")
    counts = {s: n for s, n in (("train", n_train), ("val", n_val), ("test", n_test)) if n > 0}
    if not counts:
        raise BadInput("nothing to write: every split has 0 images")
    target = out if out is not None else default_cache_root()
    if target.exists() and not target.is_dir():
        raise BadInput(f"{target}: not a directory")
    try:  # a read-only or full disk stops here, before any image is rendered
        probe_writable(target.parent if out is not None else target)
    except OSError as err:
        raise BadInput(os_error_line(err)) from err
    try:
        if out is None:
            root = ensure_world(None, seed, counts, picked, progress=not as_json, workers=workers)
        else:
            root = write_world(out, seed, counts, picked, progress=not as_json, workers=workers)
    except FileExistsError as err:
        raise BadInput(str(err)) from err
    except OSError as err:  # the disk filled up (or went read-only) while writing: nothing half-written stays
        raise click.ClickException(os_error_line(err)) from err
    meta = read_world(root)
    images = sum(meta["splits"].values()) * len(meta["classes"]) * len(meta["domains"])
    summary = {"root": str(root), "seed": seed, "version": meta["version"], "domains": meta["domains"],
               "splits": meta["splits"], "classes": len(meta["classes"]), "seen": len(meta["seen"]),
               "held_out": len(meta["held_out"]), "images": images,
               "attributes": str(root / "attributes.json"), "world": str(root / "world.json")}
    if as_json:
        emit_json(summary)
        return
    click.echo(f"world seed {seed} (v{meta['version']}) at {root}")
    click.echo(f"  {summary['classes']} classes ({summary['seen']} seen, {summary['held_out']} held out), "
               f"domains {', '.join(meta['domains'])}, {images} images")
    click.echo("  per class and domain: " + ", ".join(f"{s} {n}" for s, n in meta["splits"].items()))
    click.echo(f"  attributes: {summary['attributes']}")
