"""TorchScript export of the ``EdgeClassifier``: the module ONNX is exported from, traced with its LoRA as inputs.

Why a second artifact: a device that has PyTorch but no ONNX Runtime (or wants to compare both) runs the
same inference module (`edge-client infer --runtime torchscript`, ``edge_client/torchscript_runtime.py``).
``torch.jit.trace`` records one graph: pixel_values and the LoRA tensors in (in ``lora_names`` order),
(logits, probs, image_embeds) out, the frozen weights and attribute text features baked in as constants.
The LoRA tensors are inputs (plain tensors stand in for the module's LoRA parameters while tracing;
``torch.func.functional_call`` refuses to trace), so
the device feeds the bundle's, a personalised or a round's LoRA per run as it does for ONNX Runtime. The
trace runs through the same `plain_attention` and without the MHA fast path, like the ONNX export.
TorchScript is deprecated since torch 2.14 (FutureWarning on trace, save and load) but works; the warning
is silenced only around those calls (`quiet_torchscript`), because the bundle format pins what it writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedmvp_formats.bundle_manifest import TORCHSCRIPT_FILE, TORCHSCRIPT_FORMAT

from export import parity
from export.edge_module import EdgeClassifier, no_mha_fastpath
from export.onnx_export import INPUT_NAME, OUTPUT_NAMES, plain_attention

__all__ = ["TORCHSCRIPT_FILE", "TorchScriptParity", "export_torchscript", "logits", "manifest_section",
           "quiet_torchscript", "tensors_as_inputs", "write_checked"]


@contextlib.contextmanager
def quiet_torchscript() -> Iterator[None]:
    """torch 2.14 deprecates torch.jit (FutureWarning on every trace/save/load): the bundle format still
    uses it on purpose, so the warning says nothing the user can act on; silenced only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        yield


@contextlib.contextmanager
def tensors_as_inputs(edge: nn.Module, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
    """``edge`` reading ``tensors`` (by FQN) in place of its own parameters and buffers for a while.

    Why: the edge module reads its tensors by attribute (EdgeClassifier.tensor, nn.Linear.weight), and a
    trace records what it reads; plain tensors in their place become graph inputs, not saved constants
    (``torch.func.functional_call`` refuses to trace)."""
    held = []
    try:
        for name, value in tensors.items():
            parent, leaf = edge.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            store = parent._parameters if leaf in parent._parameters else parent._buffers
            held.append((parent, leaf, store, store.pop(leaf)))
            object.__setattr__(parent, leaf, value)
        yield
    finally:
        for parent, leaf, store, original in reversed(held):
            parent.__dict__.pop(leaf, None)
            store[leaf] = original


class _LoraInputs(nn.Module):
    """``edge`` with its LoRA parameters taken as forward inputs (traced as graph inputs, not constants)."""

    def __init__(self, edge: EdgeClassifier) -> None:
        super().__init__()
        self.edge = edge
        self.names = list(edge.lora_names)

    def forward(self, pixel_values: torch.Tensor, *lora: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with tensors_as_inputs(self.edge, dict(zip(self.names, lora))):
            return self.edge(pixel_values)


def export_torchscript(edge: EdgeClassifier, image_size: int, path: Path, batch: int = 2) -> None:
    """Trace ``edge`` (batch ``batch``; the batch dimension stays free) and save it to ``path``."""
    example = torch.zeros(batch, 3, image_size, image_size)
    lora = tuple(t.detach().clone() for t in edge.lora_tensors().values())
    wrapper = _LoraInputs(edge).eval()
    with quiet_torchscript(), no_mha_fastpath(), plain_attention(edge), torch.no_grad():
        traced = torch.jit.trace(wrapper, (example, *lora), check_trace=False)
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
    Path(path).write_bytes(portable_archive(buffer.getvalue()))


def portable_archive(archive: bytes) -> bytes:
    """What a traced module's archive keeps: the same bytes from any machine (`without_debug_info`, then
    `fixed_serialization_id`)."""
    return fixed_serialization_id(without_debug_info(archive))


def without_debug_info(archive: bytes) -> bytes:
    """``archive`` without its ``*.debug_pkl`` records.

    Why: they map the module's code back to the Python source it was traced from, by absolute path (about
    33 paths of the exporting machine: its home, its site-packages), so the same round exported in two
    environments gave different bytes and showed where it was built. torch.jit.load reads a module without
    them (its errors then name no Python line). The rest is copied in order, stored, each record's data
    aligned to 64 bytes as torch.jit.save aligns it, with a fixed time stamp."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    kept = [info for info in source.infolist() if not info.filename.endswith(".debug_pkl")]
    if len(kept) == len(source.infolist()):
        return archive
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in kept:
            record = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
            record.compress_type = zipfile.ZIP_STORED
            header = 30 + len(info.filename.encode())
            pad = (-(out.tell() + header + 4)) % 64  # the data after a 4-byte extra field header and the pad
            record.extra = struct.pack("<HH", 0xFA17, pad) + b"\0" * pad  # an ignored extra field, as torch pads
            target.writestr(record, source.read(info))
    return out.getvalue()


def fixed_serialization_id(archive: bytes) -> bytes:
    """``archive`` with its random ``.data/serialization_id`` record replaced by one derived from the rest.

    Why: torch.jit.save draws that id at random, and the same round exported twice must be the same bytes
    (``export.bundle_writer``). The record is stored uncompressed, so its bytes are overwritten in place and
    its CRC-32 fixed in the local header and in the central directory; nothing else moves. Exports in
    separate processes are then byte-identical; a second trace in one process mangles class names
    (``___torch_mangle_N``), so that archive differs (it loads and computes the same)."""
    data = bytearray(archive)
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        info = next((i for i in zf.infolist() if i.filename.endswith("/.data/serialization_id")), None)
        if info is None or info.compress_type != zipfile.ZIP_STORED:
            return archive
        size = info.file_size
        others = hashlib.sha256()
        for item in zf.infolist():
            if item is not info:
                others.update(item.filename.encode() + b"\0" + zf.read(item))
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    record = str(int(others.hexdigest(), 16))[:size].rjust(size, "0").encode()  # digits, as torch writes it
    data[start:start + size] = record
    crc = zlib.crc32(record)
    struct.pack_into("<I", data, info.header_offset + 14, crc)
    struct.pack_into("<I", data, _central_entry(data, info.filename) + 16, crc)
    return bytes(data)


def _central_entry(data: bytearray, name: str) -> int:
    """Offset of the central-directory entry of ``name`` (signature PK\\x01\\x02, name at +46)."""
    encoded, at = name.encode(), 0
    while True:
        at = data.find(b"PK\x01\x02", at)
        if at < 0:
            raise ValueError(f"no central directory entry for {name}")
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46:at + 46 + name_len]) == encoded:
            return at
        at += 4


@torch.no_grad()
def logits(path: Path, images: torch.Tensor, lora: dict[str, torch.Tensor], names: list[str],
           batch_size: int = 32) -> np.ndarray:
    """[N, C] logits of the saved module at ``path`` on ``images`` with ``lora`` fed (``names`` order)."""
    with quiet_torchscript():
        module = torch.jit.load(str(path), map_location="cpu")
    module.eval()
    feed = [lora[n].detach().float().contiguous() for n in names]
    parts = [module(images[i:i + batch_size].float(), *feed)[0] for i in range(0, len(images), batch_size)]
    return torch.cat(parts).numpy()


def manifest_section(edge: EdgeClassifier, promptformer_digest: str | None) -> dict:
    """The manifest's ``torchscript`` section: how to call the module, and the PromptFormer baked in (a
    refresh rewrites weights.safetensors but not this file, so the device offers it only while they agree)."""
    return {"file": TORCHSCRIPT_FILE, "format": TORCHSCRIPT_FORMAT, "torch_version": torch.__version__,
            "load": "torch.jit.load(path)", "inputs": [INPUT_NAME, *edge.lora_names],
            "outputs": list(OUTPUT_NAMES), "lora_inputs": list(edge.lora_names), "numerics": "fp32",
            "promptformer_digest": promptformer_digest}


class TorchScriptParity(parity.ParityResult):
    """fp32 parity of the TorchScript module against PyTorch (same rules as the ONNX model's); its own line."""

    def line(self) -> str:
        return "torchscript " + super().line()


def write_checked(edge: EdgeClassifier, image_size: int, path: Path, reference: np.ndarray,
                  images: torch.Tensor) -> TorchScriptParity:
    """Trace and save ``edge`` to ``path``, then hold the module read back to the fp32 parity rules
    (logit bound and top-1 agreement) against ``reference``, PyTorch's logits on ``images``."""
    export_torchscript(edge, image_size, path)
    names = list(edge.lora_names)
    found = parity.compare(reference, logits(path, images, edge.lora_tensors(), names), "fp32")
    return TorchScriptParity(**vars(found))
