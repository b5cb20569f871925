"""FedMVP model: what trains, what stays frozen, LoRA switch, state API, loss."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from fedmvp.atomic import save_safetensors
from fedmvp.clip import load_clip
from fedmvp.model import FedMVP, FedMVPConfig, flip_views


def batch(n=8, classes=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, classes, (n,), generator=g)


def test_shapes(tiny_model):
    images, _ = batch()
    assert tiny_model(images).shape == (8, 6)
    assert tiny_model.encode(images).norm(dim=-1).allclose(torch.ones(8))


def test_gradients_reach_only_trainable_tensors_and_clip_is_bit_identical(tiny_model):
    clip_before = {k: v.clone() for k, v in tiny_model.clip.state_dict().items()}
    images, labels = batch()
    opt = torch.optim.SGD(tiny_model.trainable_parameters(), lr=0.1, momentum=0.9)
    tiny_model.loss(images, labels)["loss"].backward()
    for name, param in tiny_model.named_parameters():
        if name.startswith("clip."):
            assert param.grad is None, name
        elif "lora_" in name:
            assert param.grad is None, name  # frozen until the switch
    assert all(p.grad is not None for p in tiny_model.trainable_parameters())
    opt.step()
    for key, value in tiny_model.clip.state_dict().items():
        assert torch.equal(value, clip_before[key]), key


def test_lora_switch_changes_nothing_then_trains_only_lora(tiny_model):
    images, labels = batch()
    tiny_model.eval()
    before = tiny_model(images)
    pf_before = tiny_model.state("promptformer")
    tiny_model.use_lora()
    assert torch.equal(tiny_model(images), before)  # B starts at zero
    assert set(tiny_model.state()) == set(tiny_model.state("lora"))
    opt = torch.optim.SGD(tiny_model.trainable_parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        tiny_model.loss(images, labels)["loss"].backward()
        opt.step()
    for key, value in tiny_model.state("promptformer").items():
        assert torch.equal(value, pf_before[key]), key
    assert not torch.equal(tiny_model(images), before)


@pytest.mark.slow  # the real ViT-B-16 architecture built (random init)
def test_vit_b16_lora_is_36864_and_267x_smaller():
    clip = load_clip("ViT-B-16", None)
    model = FedMVP(clip)
    pf = sum(v.numel() for v in model.state("promptformer").values())
    lora = sum(v.numel() for v in model.state("lora").values())
    assert (pf, lora) == (9_845_760, 36_864)
    assert round(pf / lora, 2) == 267.08
    assert sum(p.numel() for p in model.trainable_parameters()) == 9_845_760
    model.use_lora()
    assert sum(p.numel() for p in model.trainable_parameters()) == 36_864


def test_state_names_are_stable_and_roundtrip_through_safetensors(tiny_model, tiny_clip, tmp_path):
    state = tiny_model.state("all")
    assert all(k.startswith(("promptformer.", "lora.")) for k in state)
    assert "promptformer.block.attn.to_q.weight" in state  # peft's base_layer is hidden
    assert "lora.block.attn.to_v.lora_B.weight" in state
    save_safetensors(state, tmp_path / "s.safetensors")
    other = FedMVP(tiny_clip)
    other.set_text_features(tiny_model.text_features)
    other.load_state(load_file(str(tmp_path / "s.safetensors")), strict=True)
    images, _ = batch()
    tiny_model.eval(), other.eval()
    assert torch.equal(other(images), tiny_model(images))
    with pytest.raises(KeyError, match="unknown tensors"):
        other.load_state({"promptformer.nope": torch.zeros(1)})


def test_without_lora_ablation(tiny_clip):
    model = FedMVP(tiny_clip, FedMVPConfig(use_lora=False))
    assert model.state("lora") == {}
    with pytest.raises(RuntimeError, match="without LoRA"):
        model.use_lora()


def test_every_lora_target_the_record_allows_is_a_promptformer_layer(tiny_clip):
    """The method record's range for lora_targets (fedmvp_formats.method.LORA_LAYERS) builds a model."""
    from fedmvp_formats.method import LORA_LAYERS

    for target in LORA_LAYERS:
        lora = FedMVP(tiny_clip, FedMVPConfig(lora_targets=(target,))).state("lora")
        assert lora and all(f".{target}.lora_" in name for name in lora), target


def test_alpha_zero_is_plain_cross_entropy(tiny_clip):
    torch.manual_seed(0)
    model = FedMVP(tiny_clip, FedMVPConfig(alpha=0.0))
    model.set_text_features(torch.nn.functional.normalize(torch.randn(6, 10, 128), dim=-1))
    images, labels = batch()
    out = model.loss(images, labels)
    assert torch.equal(out["loss"], out["ce"]) and float(out["consistency"]) == 0.0
    expected = torch.nn.functional.cross_entropy(model(images), labels)
    assert torch.allclose(out["ce"], expected)


def test_consistency_uses_a_per_sample_flip():
    images = torch.arange(64 * 3 * 4 * 4, dtype=torch.float32).view(64, 3, 4, 4)
    views = flip_views(images, 0.5, torch.Generator().manual_seed(0))
    flipped = [bool(torch.equal(views[i], images[i].flip(-1))) for i in range(64)]
    assert 10 < sum(flipped) < 54  # neither all nor none: one coin per sample


def test_consistency_term_matches_its_definition(tiny_model):
    images, labels = batch()
    target = tiny_model.encode_frozen(images)
    out = tiny_model.loss(images, labels, frozen_targets=target)
    cos = torch.nn.functional.cosine_similarity(tiny_model.encode(images), target, dim=-1)
    assert torch.allclose(out["consistency"], (1 - cos).mean(), atol=1e-6)
    assert torch.allclose(out["loss"], out["ce"] + 10.0 * out["consistency"], atol=1e-5)


def test_thirty_sgd_steps_lower_the_loss_substantially():
    """The paper's optimiser on a fixed batch; the random CLIP gets a trained CLIP's logit scale (100)."""
    torch.manual_seed(0)
    clip = load_clip("fedmvp-tiny", None)
    clip.model.logit_scale.data.fill_(math.log(100.0))
    model = FedMVP(clip)
    model.set_text_features(torch.nn.functional.normalize(torch.randn(6, 10, 128), dim=-1))
    images, labels = batch(32)
    opt = torch.optim.SGD(model.trainable_parameters(), lr=0.003, momentum=0.9, weight_decay=1e-5)
    target = model.encode_frozen(images)
    model.train()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        out = model.loss(images, labels, frozen_targets=target)
        out["loss"].backward()
        opt.step()
        losses.append(out["loss"].item())
    assert losses[-1] < 0.7 * losses[0], losses
