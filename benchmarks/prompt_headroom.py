"""How much can prompts help the tiny CLIP at all? A centralised upper bound for `fedmvp demo`.

Why: the federated demo must beat zero-shot on Base and HM (docs/benchmarks.md, "Goals, prompts,
communication, Flower, deployment"). If even one PromptFormer trained centrally on ALL base clients'
images (pooled, the full base label space, Adam, no consistency loss) cannot beat zero-shot, no
federated schedule can, and the bottleneck is the world / tiny CLIP, not the federation.

    python benchmarks/prompt_headroom.py [--preset demo] [--steps 400] [--lr 1e-3] [--alpha 0]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help="preset name or TOML file")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--alpha", type=float, default=0.0, help="consistency weight (the paper: 10)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from fedmvp.federated.evaluation import evaluate_global
    from fedmvp.federated.prepare import method_config
    from fedmvp.federated.task import task_context
    from fedmvp.presets.schema import load_preset

    torch.manual_seed(0)
    ctx = task_context(args.preset, method_config(load_preset(args.preset).train))
    model = ctx.model
    base = next(ev for ev in ctx.federation.evaluations if ev.kind == "base")
    names = base.class_names
    images, labels = [], []
    for client in ctx.federation.clients:
        x, y = ctx.images(f"train/{client.client_id}", client.train)
        images.append(x)
        labels.append(torch.tensor([names.index(client.class_names[int(i)]) for i in y]))
    x, y = torch.cat(images), torch.cat(labels)
    features = ctx.text_features(names, base.attributes, base.style)
    model.config.alpha = args.alpha
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=args.lr)
    rows = [{"step": 0, **evaluate_global(ctx, None)}]
    began = time.perf_counter()
    for step in range(1, args.steps + 1):
        model.train()
        model.set_text_features(features)  # evaluate_global leaves other class sets behind
        idx = torch.randint(0, len(x), (args.batch_size,))
        out = model.loss(x[idx], y[idx])
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        if step % max(1, args.steps // 4) == 0:
            rows.append({"step": step, "seconds": round(time.perf_counter() - began, 1),
                         **evaluate_global(ctx, model.state("all"))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{len(x)} pooled base images, {len(names)}-way; step 0 = zero-shot")
    print(f"{'step':>6} {'Local':>7} {'Base':>7} {'New':>7} {'HM':>7} {'Domain':>7}")
    for row in rows:
        cells = " ".join(f"{100 * row[k]:7.2f}" if row[k] is not None else f"{'-':>7}"
                         for k in ("local", "base", "new", "hm", "domain"))
        print(f"{row['step']:>6} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
