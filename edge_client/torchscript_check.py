"""What a bundle's TorchScript module may hold before and after `torch.jit.load` (docs/security.md).

Why: a TorchScript archive is code. `torch.jit.load` runs a class's ``__setstate__`` while it loads, and
the module's ``forward`` may call any operator torch registers, among them ``aten::from_file``, which
maps a device file into a tensor (shared: written back). A bundle comes from the server, which a device
must not have to trust with its files. So before loading, the archive's entries must be the ones
``torch.jit.save`` writes for a traced module (plain paths under one folder, bounded sizes, no zip bomb)
and its code may define no ``__setstate__``/``__getstate__``; after loading, the module's only method is
``forward`` and every operator of its inlined graph is one the exporter's inference module uses
(``export/torchscript_export.py``; an operator outside the table is refused, not run).
"""

from __future__ import annotations

import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

from edge_client.bundle_files import BundleError, check_archive_entries, fail

# The operators of the traced inference module (image -> logits, probs, image features; LoRA as inputs),
# and the purely numerical ones an open_clip ViT variant may add. Nothing here reads or writes outside
# the module's own tensors.
ALLOWED_OPERATORS = frozenset({
    "aten::Int", "aten::Float", "aten::ScalarImplicit", "aten::_convolution", "aten::add", "aten::addmm",
    "aten::baddbmm", "aten::bmm", "aten::cat", "aten::chunk", "aten::clamp_min", "aten::clone",
    "aten::contiguous", "aten::div", "aten::dropout", "aten::einsum", "aten::exp", "aten::expand",
    "aten::expand_as", "aten::flatten", "aten::floor_divide", "aten::gelu", "aten::layer_norm",
    "aten::linalg_vector_norm", "aten::linear", "aten::matmul", "aten::mean", "aten::mm", "aten::mul",
    "aten::neg", "aten::norm", "aten::permute", "aten::pow", "aten::reshape", "aten::rsqrt", "aten::rsub",
    "aten::scaled_dot_product_attention", "aten::select", "aten::sigmoid", "aten::size", "aten::slice",
    "aten::softmax", "aten::split", "aten::sqrt", "aten::squeeze", "aten::sub", "aten::sum", "aten::t",
    "aten::tanh", "aten::to", "aten::transpose", "aten::unbind", "aten::unsqueeze", "aten::view",
    "prim::Constant", "prim::GetAttr", "prim::ListConstruct", "prim::ListUnpack", "prim::NumToTensor",
    "prim::TupleConstruct", "prim::TupleUnpack",
})
# The training module (export/torchscript_training.py) is the same edge module's forward (the prompted and the
# frozen image features, the logits) with every tensor an input: the same operators. Backward runs through
# autograd on those operators, not through code in the archive.
TRAINING_OPERATORS = ALLOWED_OPERATORS
_ENTRY = re.compile(r"(data\.pkl|constants\.pkl|traced_inputs\.pkl|version|byteorder|\.data/version|"
                    r"\.data/serialization_id|(data|constants|traced_inputs)/\d+|"
                    r"code/__torch__(/[A-Za-z0-9_]+)*/[A-Za-z0-9_]+\.py(\.debug_pkl)?)")
_LOAD_HOOKS = re.compile(rb"def\s+__(setstate|getstate)__")
_ENTRY_CAP = 1 << 31  # one tensor's storage: 2 GiB
_CODE_CAP = 8 << 20  # one code file
_MAX_RATIO = 1000  # deflated tensors and code shrink far less; more is a zip bomb


def check_archive(path: Path) -> None:
    """Refuse a TorchScript archive that holds more than a traced module's entries, or code that runs
    while it loads (``BundleError``, one line naming the file)."""
    def no_load_hooks(archive: zipfile.ZipFile, infos: list[zipfile.ZipInfo]) -> None:
        for info in infos:
            if info.filename.endswith(".py") and _LOAD_HOOKS.search(archive.read(info)):
                raise fail(path, f"archive entry {info.filename!r} defines code that runs while the module "
                                 f"loads (__setstate__/__getstate__); refusing to load it")

    check_archive_entries(path, "TorchScript", _entry_problem, no_load_hooks)


def _entry_problem(info: zipfile.ZipInfo, prefix: str, seen: set[str]) -> str | None:
    raw = info.orig_filename
    entry = f"archive entry {raw!r}"
    parts = raw.split("/")
    if "\\" in raw or "\0" in raw or len(parts) < 2 or parts[0] != prefix or any(p in ("", ".", "..")
                                                                                     for p in parts):
        return f"{entry} is not a plain path inside the archive's folder {prefix!r}"
    if not _ENTRY.fullmatch("/".join(parts[1:])):
        return f"unexpected {entry} (not one torch.jit.save writes for a traced module)"
    if raw in seen:
        return f"{entry} appears twice"
    seen.add(raw)
    cap = _CODE_CAP if "/code/" in f"/{raw}" else _ENTRY_CAP
    if info.file_size > cap:
        return f"{entry} declares {info.file_size} bytes, over its cap of {cap}"
    if info.flag_bits & 1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return f"{entry} is encrypted or uses an unknown compression"
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > _MAX_RATIO * max(info.compress_size, 1):
        return f"{entry} would inflate {info.compress_size} bytes to {info.file_size} (a zip bomb)"
    return None


def load_checked(path: Path, kind: str = "inference") -> Any:
    """The TorchScript module at ``path``, loaded only after its archive passed ``check_archive`` and run only
    after it passed ``check_module``: the one way the device loads a bundle's TorchScript (``kind``: inference
    or training). torch.jit is deprecated since torch 2.14 but is the artifact's format: its warning is quiet."""
    import torch

    check_archive(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            module = torch.jit.load(str(path), map_location="cpu")
        except Exception as err:  # noqa: BLE001 - torch raises many kinds for a bad archive
            raise fail(path, f"cannot load the TorchScript {kind} module with torch {torch.__version__} "
                             f"({' '.join(str(err).split())[:300]})") from None
    check_module(path, module, kind)
    return module


def check_module(path: Path, module: Any, kind: str = "inference") -> None:
    """Refuse a loaded module that offers more than ``forward`` or whose forward calls an operator the
    exporter's ``kind`` module (inference, or training: ``export/torchscript_training.py``) never uses
    (``BundleError``)."""
    methods = sorted(module._c._method_names())
    if methods != ["forward"]:
        raise fail(path, f"the TorchScript module has methods {methods}, not only forward; refusing to run it")
    unknown = sorted(_operators(module.inlined_graph) - (TRAINING_OPERATORS if kind == "training"
                                                         else ALLOWED_OPERATORS))
    if unknown:
        raise fail(path, f"the TorchScript module calls operators no fedmvp {kind} module uses "
                         f"({', '.join(unknown[:5])}); refusing to run it")


def _operators(block: Any) -> set[str]:
    kinds: set[str] = set()
    for node in block.nodes():
        kinds.add(node.kind())
        for inner in node.blocks():
            kinds |= _operators(inner)
    return kinds


__all__ = ["ALLOWED_OPERATORS", "TRAINING_OPERATORS", "BundleError", "check_archive", "check_module"]
