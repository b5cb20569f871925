"""Prompt injection is a subclass of open_clip's ViT: no private member is reached from outside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fedmvp.prompted_vit import PromptedVisionTransformer, encode_image_prompted, prompted

SOURCE = Path(__file__).resolve().parents[1] / "fedmvp" / "prompted_vit.py"
INTERNAL = {"_pool", "_embeds", "patch_dropout", "ln_pre", "transformer", "proj"}  # forward's own steps


def outside_uses(tree: ast.AST) -> list[str]:
    """``obj.attr`` with attr one of forward's internal steps (or private) and obj not ``self``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in INTERNAL or node.attr.startswith("_")) \
                and not node.attr.startswith("__") and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


@pytest.mark.parametrize(("code", "expected"), [
    ("def f(visual):\n    return visual._pool(x)", ["visual._pool (line 2)"]),
    ("def f(visual):\n    return visual.ln_pre(x)", ["visual.ln_pre (line 2)"]),
    ("class A:\n    def f(self):\n        return self._pool(x)", []),
])
def test_the_checker_sees_outside_calls(code, expected):
    assert outside_uses(ast.parse(code)) == expected


def test_prompted_vit_reaches_nothing_private_from_outside():
    assert outside_uses(ast.parse(SOURCE.read_text(encoding="utf-8"))) == []


def test_prompted_is_the_same_module_with_the_same_forward(tiny_clip):
    visual = tiny_clip.model.visual
    images = torch.randn(2, 3, tiny_clip.image_size, tiny_clip.image_size)
    keys = list(visual.state_dict())
    same = prompted(visual)
    assert same is visual and isinstance(visual, PromptedVisionTransformer) and prompted(visual) is visual
    assert list(visual.state_dict()) == keys
    assert torch.equal(encode_image_prompted(visual, images), visual(images))


def test_other_encoders_are_refused():
    with pytest.raises(TypeError, match="VisionTransformer"):
        prompted(torch.nn.Linear(2, 2))
