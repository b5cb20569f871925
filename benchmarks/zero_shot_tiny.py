"""Zero-shot top-1 of the shipped tiny CLIP on the synthetic world's test split.

Seen (48-way) vs held-out (16-way) compositions, per domain, with name-only prompts
("a photo of a zorblin") and with the 10 attribute sentences per class, chance beside each.

    python benchmarks/zero_shot_tiny.py                     # shipped weights, default world
    python benchmarks/zero_shot_tiny.py --json out.json     # also write the figures as JSON
    python benchmarks/zero_shot_tiny.py --record            # refresh the figures the drift test checks
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedmvp.atomic import write_json  # noqa: E402
from fedmvp.clip import load_clip  # noqa: E402
from fedmvp.synthetic.writer import ensure_world  # noqa: E402
from fedmvp.synthetic.zero_shot import format_table, world_zero_shot  # noqa: E402

RECORD = REPO / "fedmvp" / "weights" / "fedmvp-tiny-synthetic.zero-shot.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="fedmvp-tiny")
    parser.add_argument("--pretrained", default="synthetic", help="tag or weights file")
    parser.add_argument("--root", default=None, help="a written world (default: the cached default world)")
    parser.add_argument("--seed", type=int, default=0, help="world seed when --root is not given")
    parser.add_argument("--split", default="test")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", dest="json_out", default=None, help="write the figures to this JSON file")
    parser.add_argument("--record", action="store_true",
                        help=f"write the figures to {RECORD.relative_to(REPO)} (read by tests/test_tiny_clip.py)")
    args = parser.parse_args(argv)

    logging.getLogger().setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    start = time.time()
    root = Path(args.root) if args.root else ensure_world(seed=args.seed, progress=True)
    clip = load_clip(args.model, args.pretrained)
    report = world_zero_shot(clip, root, split=args.split)
    report["seconds"] = round(time.time() - start, 1)
    print(f"zero-shot top-1 (%) of {args.model} / {args.pretrained} on the {args.split} split of world seed "
          f"{report['world']['seed']} (v{report['world']['version']}), "
          f"{report['world']['splits'][args.split]} images per class and domain\n")
    print(format_table(report))
    if args.json_out:
        write_json(args.json_out, report)
    if args.record:
        write_json(RECORD, report)
        print(f"\nrecorded -> {RECORD.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
