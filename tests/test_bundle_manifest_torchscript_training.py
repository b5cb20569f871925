"""The manifest's ``torchscript_training`` section (train.torchscript.pt): it and its role come together, its file
is the role's, its format torch.jit, its LoRA inputs the bundle's; each break is one line naming the field."""

from __future__ import annotations

import copy

import pytest

from fedmvp_formats.bundle_manifest import (TORCHSCRIPT_FORMAT, TORCHSCRIPT_TRAINING_FILE, TORCHSCRIPT_TRAINING_ROLE,
                                            check_manifest)
from tests.test_bundle_manifest import WHERE, _error, manifest

LORA = "lora.block.attn.to_q.lora_A.weight"


def with_module() -> dict:
    m = manifest()
    m["files"][TORCHSCRIPT_TRAINING_FILE] = {"sha256": "0" * 64, "bytes": 10}
    m["files_by_role"][TORCHSCRIPT_TRAINING_ROLE] = TORCHSCRIPT_TRAINING_FILE
    m[TORCHSCRIPT_TRAINING_ROLE] = {"file": TORCHSCRIPT_TRAINING_FILE, "format": TORCHSCRIPT_FORMAT,
                                    "lora_inputs": [LORA], "weight_inputs": []}
    return m


def test_a_manifest_with_the_module_passes():
    check_manifest(with_module(), WHERE)


BAD = [
    ("role alone", lambda m: m.pop(TORCHSCRIPT_TRAINING_ROLE), "field torchscript_training: missing, but files_by_role"),
    ("section alone", lambda m: m["files_by_role"].pop(TORCHSCRIPT_TRAINING_ROLE), "field torchscript_training.file"),
    ("format", lambda m: m[TORCHSCRIPT_TRAINING_ROLE].update(format="torch.export"), "torchscript_training.format"),
    ("lora inputs", lambda m: m[TORCHSCRIPT_TRAINING_ROLE].update(lora_inputs=["lora.other"]),
     "field torchscript_training.lora_inputs: must list the bundle's LoRA tensors"),
]


@pytest.mark.parametrize("what, edit, says", BAD, ids=[b[0] for b in BAD])
def test_each_broken_module_section_is_one_line(what, edit, says):
    m = copy.deepcopy(with_module())
    edit(m)
    assert says in _error(m)
