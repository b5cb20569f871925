"""The bundle's parsers, attacked directly: each safetensors attack at every place edge_client loads one,
ONNX external data wherever a tensor can hide it (and ONNX Runtime's own refusal, kept as a watch), the
training program's archive checks, and the real bundle's files passing them all.

Companion of test_bundle_attacks.py (the same attacks through the commands a user types).
"""

from __future__ import annotations

import sys
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forge import (PROGRAM_PREFIX, SAFETENSORS_ATTACKS, deflated_blob, external_model, payload,  # noqa: E402
                   pickled_weight_config, program_entries, replace_entry, tamper_safetensors, write_program)

from edge_client.bundle import Bundle, BundleError, read_bundle, verify_program_archive  # noqa: E402
from edge_client.bundle_files import check_onnx_external  # noqa: E402
from edge_client.protobuf import onnx_external_data  # noqa: E402
from edge_client.safetensors_check import CHECK_ITEMSIZE, check_safetensors, load_safetensors  # noqa: E402
from fedmvp_formats.bundle_manifest import ROLES  # noqa: E402
from edge_client.tensor_layout import safetensors_layout  # noqa: E402
from edge_client.update import UpdateError, read_update, write_update  # noqa: E402


# ---- safetensors: every attack at every loader -------------------------------------------------------
def _bundle_lora(path: Path) -> object:
    """Bundle.lora() on a bundle whose LoRA file is ``path`` (what inference and training start from)."""
    bundle = Bundle(path=path.parent, manifest={"files_by_role": {"lora": path.name}})
    return bundle.lora()


LOADERS: dict[str, tuple[Callable[[Path], object], type[Exception]]] = {
    "check": (check_safetensors, BundleError),
    "numpy": (load_safetensors, BundleError),
    "torch": (lambda p: load_safetensors(p, framework="pt"), BundleError),
    "layout": (safetensors_layout, BundleError),  # the refresh patches tensors where this says they lie
    "bundle-lora": (_bundle_lora, BundleError),
    "update": (read_update, UpdateError),  # personalised LoRAs and `fedmvp ingest`'s input
}


@pytest.fixture(scope="module")
def update_file(pristine_bundle: Path, tmp_path_factory) -> Path:
    bundle = read_bundle(pristine_bundle)
    out = tmp_path_factory.mktemp("update") / "u.safetensors"
    return write_update(out, bundle.lora(), bundle=bundle, num_examples=1, mean_loss=1.0)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("attack", SAFETENSORS_ATTACKS)
def test_safetensors_attack_refused_by_every_loader(attack: str, loader: str, update_file: Path,
                                                    tmp_path: Path) -> None:
    path = tmp_path / "lora.safetensors"
    path.write_bytes(update_file.read_bytes())
    tamper_safetensors(path, attack)
    load, error = LOADERS[loader]
    with pytest.raises(error) as info:
        load(path)
    message = str(info.value)
    reason = SAFETENSORS_ATTACKS[attack][1]
    assert "\n" not in message and message.startswith(f"{path}: not a safetensors file ({reason}")


@pytest.mark.parametrize("attack", ["huge-header-length", "terabyte-shape", "deeply-nested-json"])
def test_safetensors_refused_before_allocating(attack: str, update_file: Path, tmp_path: Path) -> None:
    """The check allocates about the header, never what the header claims."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(update_file.read_bytes())
    tamper_safetensors(path, attack)
    tracemalloc.start()
    try:
        with pytest.raises(BundleError):
            check_safetensors(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * path.stat().st_size + (4 << 20)


def test_real_safetensors_pass_as_the_library_reads_them(pristine_bundle: Path) -> None:
    from safetensors import safe_open

    for path in sorted(pristine_bundle.glob("*.safetensors")):  # the check images alone hold uint8 pictures
        checked = check_safetensors(path, dtypes=CHECK_ITEMSIZE if path.name == ROLES["check"] else None)
        with safe_open(str(path), "np") as handle:
            assert sorted(checked) == sorted(handle.keys())
            for name, entry in checked.items():
                assert list(entry.shape) == list(handle.get_slice(name).get_shape())


# ---- model.onnx: external data -----------------------------------------------------------------------
def test_onnx_runtime_itself_refuses_external_data_outside_the_model_directory(tmp_path: Path) -> None:
    """A watch on ONNX Runtime: today it refuses these too (our check runs before it, in read_bundle)."""
    ort = pytest.importorskip("onnxruntime")
    np.arange(4, dtype=np.float32).tofile(tmp_path / "secret.bin")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "link.bin").symlink_to(tmp_path / "secret.bin")
    for location in ("../secret.bin", str(tmp_path / "secret.bin"), "sub/../../secret.bin", "link.bin"):
        (tmp_path / "m" / "model.onnx").write_bytes(external_model(location).SerializeToString())
        with pytest.raises(Exception, match="[Ee]xternal data path"):
            ort.InferenceSession(str(tmp_path / "m" / "model.onnx"), providers=["CPUExecutionProvider"])


def _hidden(where: str, location: str):
    """A model whose external tensor sits in ``where``: an initializer, a Constant node, an If branch,
    a function body, a sparse initializer."""
    from onnx import TensorProto, helper

    model = external_model(location)
    if where == "initializer":
        return model
    tensor = model.graph.initializer.pop()
    model.graph.initializer.append(helper.make_tensor("w", TensorProto.FLOAT, [4], [0.0] * 4))
    constant = helper.make_node("Constant", [], ["c"], value=tensor)
    if where == "constant":
        model.graph.node.append(constant)
    elif where == "subgraph":
        branch = helper.make_graph([constant], "b", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
        model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    elif where == "function":
        model.functions.append(helper.make_function("f", "F", [], ["c"], [constant], [helper.make_opsetid("", 17)]))
    elif where == "sparse":
        indices = helper.make_tensor("i", TensorProto.INT64, [4], [0, 1, 2, 3])
        model.graph.sparse_initializer.append(helper.make_sparse_tensor(tensor, indices, [4]))
    return model


@pytest.mark.parametrize("where", ["initializer", "constant", "subgraph", "function", "sparse"])
@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "a\\..\\..\\x", "unlisted.bin", "dir/w.bin"])
def test_external_data_found_wherever_it_hides(where: str, location: str, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(_hidden(where, location).SerializeToString())
    assert {(name, entries["location"]) for name, entries in onnx_external_data(path)} == {("w", location)}
    with pytest.raises(BundleError, match="not from a file the manifest lists") as info:
        check_onnx_external(path, {"model.onnx": path.stat().st_size, "w.bin": 16})
    assert str(info.value).startswith(f"{path}: external data of tensor 'w'")


def test_external_data_within_a_listed_file(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(external_model("w.bin", offset=8, length=16).SerializeToString())
    check_onnx_external(path, {"w.bin": 24})
    with pytest.raises(BundleError, match="lie outside w.bin"):
        check_onnx_external(path, {"w.bin": 23})


def test_real_model_external_data_is_what_onnx_sees(pristine_bundle: Path) -> None:
    onnx = pytest.importorskip("onnx")
    model = onnx.load(str(pristine_bundle / "model.onnx"), load_external_data=False)
    expected = sorted((t.name, {e.key: e.value for e in t.external_data}["location"]) for t in model.graph.initializer
                      if t.data_location == onnx.TensorProto.EXTERNAL)
    found = sorted((name, entries["location"]) for name, entries in onnx_external_data(pristine_bundle / "model.onnx"))
    assert found == expected and len(found) > 10


# ---- train.pt2 ---------------------------------------------------------------------------------------
def test_torch_would_run_the_pickle_the_archive_check_refuses(pristine_bundle: Path, tmp_path: Path) -> None:
    """Why the archive check matters: torch.export.load unpickles what the weights config names."""
    torch = pytest.importorskip("torch")
    evil, marker = tmp_path / "evil.pt2", tmp_path / "marker"
    entries = replace_entry(program_entries(pristine_bundle / "train.pt2"),
                            PROGRAM_PREFIX + "data/weights/model_weights_config.json", pickled_weight_config())
    write_program(evil, [*entries, (PROGRAM_PREFIX + "data/weights/weight_0", payload(marker))])
    with pytest.raises(BundleError, match="weight_0"):
        verify_program_archive(evil)
    assert not marker.exists()
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises afterwards, the payload already ran
        torch.export.load(str(evil))
    assert marker.exists()


def test_program_compression_bomb_refused_from_the_directory(pristine_bundle: Path, tmp_path: Path) -> None:
    """64 MiB of deflated whitespace: refused on its declared ratio, without inflating it."""
    model_json = PROGRAM_PREFIX + "models/model.json"
    bomb = tmp_path / "bomb.pt2"
    write_program(bomb, replace_entry(program_entries(pristine_bundle / "train.pt2"), model_json,
                                      deflated_blob(64 << 20)), {model_json: zipfile.ZIP_DEFLATED})
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match="zip bomb"):
            verify_program_archive(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("method", [zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_program_with_other_compression_refused(method: int, pristine_bundle: Path, tmp_path: Path) -> None:
    path = tmp_path / "t.pt2"
    write_program(path, program_entries(pristine_bundle / "train.pt2"), {PROGRAM_PREFIX + "archive_format": method})
    with pytest.raises(BundleError, match=f"compression method {method}"):
        verify_program_archive(path)


def test_real_bundle_passes_every_check(pristine_bundle: Path) -> None:
    """No false alarm: the exporter's own bundle reads, its program verifies."""
    verify_program_archive(pristine_bundle / "train.pt2")
    assert read_bundle(pristine_bundle).lora()
