"""What the prompts cost over plain CLIP, and why the attribute text features are cached.

Rows (``runtime``): ``torch_plain`` (open_clip's image encoder), ``torch_prompted`` (fedmvp with
cached attribute features: the PromptFormer projects the C x K features per call),
``torch_prompted_edge`` (the exported form: attribute keys/values precomputed, only the query side
per image), ``promptformer_only`` (the PromptFormer alone on patch embeddings), and at batch 1
``torch_prompted_reencode`` (the attribute sentences re-encoded by the text tower every forward,
as the official code does). Ratios: cached vs re-encoding, prompted vs plain against the FLOP
floor (FLOPs counted by torch; the floor is the prompted model's FLOPs over plain CLIP's).

    python -m benchmarks prompts --model ViT-B-16
"""

from __future__ import annotations

import time

import torch

from benchmarks.common import Goal, Options, Section, interleaved_medians, ratio, set_threads


def _flops(fn, *args) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from export.onnx_export import no_mha_fastpath

    counter = FlopCounterMode(display=False)
    with no_mha_fastpath(), torch.no_grad(), counter:
        fn(*args)
    return counter.get_total_flops() / 1e9


def run(options: Options) -> Section:
    from benchmarks.edge_models import class_set, load_backbone
    from export.class_set import text_features
    from export.edge_module import build_edge_classifier
    from fedmvp.model import FedMVP
    from fedmvp.prompted_vit import patch_embeds

    start = time.perf_counter()
    threads = set_threads(options.threads)
    name = options.model or ("fedmvp-tiny" if options.quick else "ViT-B-16")
    classes, attributes = (16, 3) if options.quick else (100, 10)
    batches = [1, 2] if options.quick else [1, 8]
    clip = load_backbone(name, "synthetic" if name == "fedmvp-tiny" else None)
    model = FedMVP(clip).eval()
    sentences = class_set(classes, attributes)
    encode_start = time.perf_counter()
    features = text_features(clip, sentences)
    encode_seconds = time.perf_counter() - encode_start
    model.set_text_features(features)
    edge = build_edge_classifier(model, features)
    visual = clip.model.visual
    section = Section("prompts", config={"model": name, "classes": classes, "attributes_per_class": attributes,
                                         "sentences": classes * attributes, "batches": batches,
                                         "threads": threads, "repeats": options.reps()})
    x1 = torch.zeros(1, 3, clip.image_size, clip.image_size)
    gflop = {"plain": _flops(visual, x1), "prompted": _flops(model, x1), "edge": _flops(edge, x1),
             "promptformer": _flops(model.promptformer, patch_embeds(visual, x1)[:, 1:], model.text_features)}
    floor = gflop["prompted"] / gflop["plain"]
    for batch in batches:
        x = torch.randn(batch, 3, clip.image_size, clip.image_size)
        with torch.inference_mode():
            patches = patch_embeds(visual, x)[:, 1:].contiguous()
        fns = {"torch_plain": lambda: visual(x), "torch_prompted": lambda: model(x),
               "torch_prompted_edge": lambda: edge(x),
               "promptformer_only": lambda: model.promptformer(patches, model.text_features)}
        with torch.inference_mode():
            medians = interleaved_medians(fns, options.reps())
        for key, seconds in medians.items():
            section.rows.append({"runtime": key, "batch": batch, "ms_per_batch": round(1000 * seconds, 2),
                                 "ms_per_image": round(1000 * seconds / batch, 2)})
    reencode = None
    if not options.quick or classes * attributes <= 64:
        from fedmvp.attributes.cache import TextFeatureCache

        def reencode_forward():
            fresh = text_features(clip, sentences, cache=TextFeatureCache(use_disk=False))
            model.set_text_features(fresh)
            return model(x1)

        with torch.inference_mode():
            reencode = interleaved_medians({"r": reencode_forward}, max(1, min(3, options.reps())), warmup=0)["r"]
        model.set_text_features(features)
        section.rows.append({"runtime": "torch_prompted_reencode", "batch": 1, "ms_per_batch": round(1000 * reencode, 2),
                             "ms_per_image": round(1000 * reencode, 2)})
    ms = {(r["runtime"], r["batch"]): r["ms_per_image"] for r in section.rows}
    big = batches[-1]
    section.config.update({"gflop_per_image": {k: round(v, 3) for k, v in gflop.items()},
                           "flop_floor": round(floor, 4), "text_encode_seconds": round(encode_seconds, 3)})
    section.ratios = {
        "cached_vs_reencode_b1": ratio(reencode and 1000 * reencode, ms[("torch_prompted", 1)]),
        f"torch_prompted_vs_plain_b{big}": ratio(ms[("torch_prompted", big)], ms[("torch_plain", big)]),
        f"torch_prompts_vs_floor_b{big}": ratio(ratio(ms[("torch_prompted", big)], ms[("torch_plain", big)]), floor),
        f"torch_edge_prompts_vs_floor_b{big}": ratio(ratio(ms[("torch_prompted_edge", big)], ms[("torch_plain", big)]),
                                                    gflop["edge"] / gflop["plain"]),
        f"promptformer_share_b{big}": ratio(ms[("promptformer_only", big)], ms[("torch_prompted", big)]),
    }
    section.ratios = {k: (round(v, 4) if v is not None else None) for k, v in section.ratios.items()}
    section.goals = [Goal.at_most(f"prompts' cost over their FLOP floor (PyTorch, exported form), b{big}",
                                  section.ratios[f"torch_edge_prompts_vs_floor_b{big}"], 1.05)]
    section.notes.append(f"FLOP floor of the prompts: {floor:.3f}x plain CLIP ({gflop['prompted']:.2f} vs "
                         f"{gflop['plain']:.2f} GFLOP per image; exported form {gflop['edge']:.2f})")
    section.seconds = round(time.perf_counter() - start, 1)
    return section


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sections_cli import section_main, show_table

    return section_main(run, show_table, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
