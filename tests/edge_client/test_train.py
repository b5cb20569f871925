"""edge_client.train / update / lora_store: LoRA-only training, update files, personalisation, rollback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from edge_helpers import LORA, preprocess_batch, rebuilt_model, tree_bytes, write_local_data
from PIL import Image

from edge_client.bundle import BundleError, read_bundle
from fedmvp_apps.edge_cli import main
from edge_client.infer import Predictor
from edge_client.lora_store import NothingToRollBack, active_lora, apply_update, rollback
from edge_client.program import GraphRunner, load_program
from edge_client.batch_fit import find_batch_size
from edge_client.local_data import decode_dataset, scan_folder
from edge_client.train import train_local
from edge_client.train_options import TrainingError, TrainInputError, TrainOptions
from fedmvp_formats.bundle_manifest import DEVICE_ID_FILE, manifest_bytes
from edge_client.update import UpdateError, read_update, write_update
from fedmvp_formats.objective import fedmvp_objective

LOCAL_CLASSES = ["purple_cross", "orange_ring", "yellow_star"]


def _images(data_root: Path, spec, n: int = 6) -> np.ndarray:
    files = sorted((data_root / "test").rglob("*.png"))[::8][:n]
    return preprocess_batch([Image.open(f).convert("RGB") for f in files], spec)


def _dataset_loss(bundle, data: Path, lora: dict[str, np.ndarray]) -> float:
    """Mean training loss over ``data`` with a fixed (unflipped) view: comparable before/after."""
    from safetensors.torch import load_file

    dataset = scan_folder(data, bundle.class_names)
    pixels, labels = decode_dataset(dataset, bundle.preprocess)
    spec = bundle.preprocess
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255.0
    x = (x - torch.tensor(spec.mean).view(1, 3, 1, 1)) / torch.tensor(spec.std).view(1, 3, 1, 1)
    weights = load_file(str(bundle.file("weights")))
    with torch.no_grad():
        out = load_program(bundle)(x, x, {k: torch.from_numpy(v) for k, v in lora.items()}, weights)
        return float(fedmvp_objective(*out, torch.from_numpy(labels), 10.0, torch.nn.functional)["loss"])


@pytest.fixture(scope="module")
def trained(edge_bundle, data_root, tmp_path_factory):
    """One local training run on a private copy of the bundle, with what it looked like before."""
    work = tmp_path_factory.mktemp("trained")
    bundle_path = work / "bundle"
    shutil.copytree(edge_bundle, bundle_path)
    data = write_local_data(work / "local", LOCAL_CLASSES)
    bundle = read_bundle(bundle_path)
    before_files = tree_bytes(bundle_path)
    predictor = Predictor(bundle, provider="cpu")
    images = _images(data_root, predictor.spec)
    outputs_before = predictor.run(images)
    lora_before = {k: v.copy() for k, v in bundle.lora().items()}
    loss_before = _dataset_loss(bundle, data, lora_before)
    result = train_local(data, bundle_path, epochs=4, batch_size=6, lr=0.02, out=work / "updates", threads=1,
                         seed=3)
    return {"bundle": bundle_path, "data": data, "result": result, "images": images,
            "outputs_before": outputs_before, "lora_before": lora_before, "loss_before": loss_before,
            "files_before": before_files}


def test_training_lowers_the_loss_and_changes_only_lora(trained):
    result, bundle = trained["result"], read_bundle(trained["bundle"])
    assert result.num_examples == 12 and result.classes == sorted(LOCAL_CLASSES) and result.epochs == 4
    assert result.device == "cpu" and result.batch_size == 6 and result.alpha == 10.0
    assert len(result.epoch_losses) == 4 and result.epoch_losses[-1] < result.epoch_losses[0]
    update = read_update(result.update_path, bundle)
    assert _dataset_loss(bundle, trained["data"], update.tensors) < trained["loss_before"]
    # Only the LoRA changed: the update holds exactly the LoRA tensors, every one of them moved,
    # and every exported file (frozen weights, ONNX, program) is byte for byte what it was.
    assert sorted(update.tensors) == sorted(LORA)
    assert all(not np.array_equal(update.tensors[k], trained["lora_before"][k]) for k in LORA)
    after = tree_bytes(trained["bundle"])
    assert DEVICE_ID_FILE in after  # the device's id, kept with its first update (edge_client.device_id)
    kept = {k: v for k, v in after.items() if not k.startswith("personalised/") and k != DEVICE_ID_FILE}
    assert kept == {k: v for k, v in trained["files_before"].items() if k != DEVICE_ID_FILE}
    assert sorted(k for k in after if k.startswith("personalised/")) == \
        ["personalised/lora-0001.safetensors", "personalised/state.json"]


def test_update_file_round_trips(trained):
    result, bundle = trained["result"], read_bundle(trained["bundle"])
    update = read_update(result.update_path, bundle)
    m = update.metadata
    assert m["format"] == "fedmvp-edge-update" and m["format_version"] == 1
    assert m["bundle_id"] == bundle.id and update.round == bundle.round == 2 and update.num_examples == 12
    assert abs(update.mean_loss - result.mean_loss) < 1e-9 and m["epochs"] == 4 and m["classes"] == result.classes
    assert m["created"].endswith("Z") and m["train_seconds"] > 0 and m["device"] == "cpu"
    assert len(m["images_digest"]) == 64  # the images trained on: ingest counts them once (test_ingest.py)
    assert all(np.array_equal(result.tensors[k], update.tensors[k]) for k in LORA)  # the file holds the result
    # The personalised copy is the update, byte for byte, and is what inference now runs.
    assert (trained["bundle"] / "personalised" / "lora-0001.safetensors").read_bytes() == \
        result.update_path.read_bytes()
    active = active_lora(bundle)
    assert active.personalised and all(np.array_equal(active.tensors[k], update.tensors[k]) for k in LORA)
    # write -> read keeps tensors and metadata exactly.
    again = write_update(trained["bundle"].parent / "again.safetensors", update.tensors, bundle=bundle,
                         num_examples=7, mean_loss=0.125, epochs=2)
    back = read_update(again, bundle)
    assert all(np.array_equal(back.tensors[k], update.tensors[k]) for k in LORA)
    assert back.num_examples == 7 and back.mean_loss == 0.125 and back.metadata["epochs"] == 2
    torch_tensors = {k: torch.from_numpy(v) for k, v in update.tensors.items()}  # torch tensors are accepted too
    assert read_update(write_update(again, torch_tensors, bundle=bundle, num_examples=1, mean_loss=1.0), bundle)


def test_training_without_out_keeps_the_lora_in_memory_and_personalises_from_it(edge_bundle, tmp_path,
                                                                              monkeypatch):
    """``out=None`` (a federation node without --out): no update file anywhere, the result holds the
    trained tensors; with apply, the personalised LoRA is exactly those tensors, stored as an update."""
    path = tmp_path / "bundle"
    shutil.copytree(edge_bundle, path)
    data = write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    monkeypatch.chdir(tmp_path)  # a relative default (./updates) would land here
    before = {p for p in tmp_path.rglob("*") if "personalised" not in p.parts}
    result = train_local(data, path, epochs=1, batch_size=4, lr=0.05, threads=1, start="bundle", out=None)
    assert result.update_path is None and result.to_json()["update"] is None
    after = {p for p in tmp_path.rglob("*") if "personalised" not in p.parts}
    assert after - {path / DEVICE_ID_FILE} == before - {path / DEVICE_ID_FILE}  # no update file
    assert (path / DEVICE_ID_FILE).is_file()  # personalised: the device's id is kept
    bundle = read_bundle(path)
    assert sorted(result.tensors) == sorted(LORA)
    assert all(v.dtype == np.float32 and list(v.shape) == bundle.lora_shapes[k] for k, v in result.tensors.items())
    assert any(not np.array_equal(result.tensors[k], bundle.lora()[k]) for k in LORA)
    active = active_lora(bundle)
    assert active.personalised and all(np.array_equal(active.tensors[k], result.tensors[k]) for k in LORA)
    stored = read_update(active.file, bundle)  # the personalised file is a valid update of this bundle
    assert stored.num_examples == 4 and "source" not in active.entry["update"]


def test_read_update_rejects_bad_files(trained, tmp_path):
    bundle = read_bundle(trained["bundle"])
    good = read_update(trained["result"].update_path, bundle)
    from safetensors.numpy import save_file

    wrong_shape = {**good.tensors, LORA[0]: np.zeros((4, 4), np.float32)}
    with pytest.raises(UpdateError, match="shape"):
        write_update(tmp_path / "x.safetensors", wrong_shape, bundle=bundle, num_examples=1, mean_loss=1.0)
    missing = {k: v for k, v in good.tensors.items() if k != LORA[1]}
    save_file(missing, str(tmp_path / "missing.safetensors"), metadata={
        **{k: str(v) for k, v in good.metadata.items() if k != "classes"}})
    with pytest.raises(UpdateError, match="missing"):
        read_update(tmp_path / "missing.safetensors", bundle)
    save_file(good.tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(UpdateError, match="not a fedmvp-edge-update"):
        read_update(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(UpdateError, match="not a safetensors"):
        read_update(tmp_path / "junk.safetensors")
    other = {k: str(v) for k, v in good.metadata.items() if k != "classes"}
    other["bundle_id"] = "f" * 64
    save_file(good.tensors, str(tmp_path / "other.safetensors"), metadata=other)
    with pytest.raises(UpdateError, match="not on this bundle"):
        read_update(tmp_path / "other.safetensors", bundle)
    assert read_update(tmp_path / "other.safetensors", bundle, check_bundle_id=False).num_examples == 12
    with pytest.raises(UpdateError):
        apply_update(bundle, tmp_path / "other.safetensors")


def test_personalised_onnx_equals_pytorch_with_the_same_lora(trained, edge_run):
    bundle = read_bundle(trained["bundle"])
    lora = read_update(trained["result"].update_path, bundle).tensors
    predictor = Predictor(bundle, provider="cpu")
    assert predictor.lora.personalised
    onnx_out = predictor.run(trained["images"])
    model = rebuilt_model(edge_run)
    model.load_state({k: torch.from_numpy(v) for k, v in lora.items()})
    with torch.no_grad():
        expected = model(torch.from_numpy(trained["images"])).numpy()
    np.testing.assert_allclose(onnx_out["logits"], expected, atol=1e-4)
    assert np.abs(onnx_out["logits"] - trained["outputs_before"]["logits"]).max() > 1e-4  # personalisation acted
    # The bundle's own LoRA is still one flag away, unchanged.
    exported = Predictor(bundle, provider="cpu", personalised=False).run(trained["images"])
    np.testing.assert_array_equal(exported["logits"], trained["outputs_before"]["logits"])


def test_rollback_restores_previous_outputs_exactly(trained, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(trained["bundle"], path)
    bundle = read_bundle(path)
    images = trained["images"]
    personal = Predictor(bundle, provider="cpu").run(images)
    # A second update on top: rollback must return to the first personalisation, then to the bundle.
    rng = np.random.default_rng(0)
    second = {k: (v + rng.normal(0, 0.05, v.shape)).astype(np.float32) for k, v in active_lora(bundle).tensors.items()}
    apply_update(bundle, write_update(tmp_path / "u2.safetensors", second, bundle=bundle, num_examples=3,
                                      mean_loss=1.0))
    assert active_lora(bundle).history == 1
    assert not np.array_equal(Predictor(bundle, provider="cpu").run(images)["probs"], personal["probs"])
    out = CliRunner().invoke(main, ["rollback", "--bundle", str(path), "--json"])
    assert out.exit_code == 0 and json.loads(out.stdout)["active"]["source"] == "personalised"
    for name in ("logits", "probs", "image_embeds"):
        np.testing.assert_array_equal(Predictor(bundle, provider="cpu").run(images)[name], personal[name])
    rolled = rollback(bundle)
    assert rolled.source == "bundle"
    back = Predictor(bundle, provider="cpu").run(images)
    for name in ("logits", "probs", "image_embeds"):
        np.testing.assert_array_equal(back[name], trained["outputs_before"][name])
    with pytest.raises(NothingToRollBack):
        rollback(bundle)
    out = CliRunner().invoke(main, ["rollback", "--bundle", str(path)])
    assert out.exit_code == 1 and "nothing to roll back" in out.stderr
    assert sorted(p.name for p in (path / "personalised").iterdir()) == ["state.json"]  # old files cleaned up
    assert read_bundle(path)  # hashes still verify


def test_tampered_personalised_lora_is_refused(trained, tmp_path, data_root):
    path = tmp_path / "bundle"
    shutil.copytree(trained["bundle"], path)
    lora_file = path / "personalised" / "lora-0001.safetensors"
    data = bytearray(lora_file.read_bytes())
    data[-3] ^= 0x01
    lora_file.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="sha256"):
        Predictor(path, provider="cpu")
    out = CliRunner().invoke(main, ["infer", str(data_root / "test"), "--bundle", str(path)])
    assert out.exit_code == 2 and "sha256" in out.stderr
    out = CliRunner().invoke(main, ["rollback", "--all", "--bundle", str(path)])
    assert out.exit_code == 0 and not (path / "personalised").exists()
    assert Predictor(path, provider="cpu").lora.source == "bundle"


def test_interrupted_training_leaves_everything_unchanged(trained, tmp_path):
    path = tmp_path / "bundle"
    shutil.copytree(trained["bundle"], path)  # personalised already: state must survive too
    before = tree_bytes(path)

    def interrupt(step: int, loss: float) -> None:
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_local(trained["data"], path, epochs=3, batch_size=4, out=tmp_path / "updates", threads=1,
                    on_step=interrupt)
    assert tree_bytes(path) == before
    assert not (tmp_path / "updates").exists() or not any((tmp_path / "updates").iterdir())


def test_unknown_class_is_a_clear_error(edge_bundle, tmp_path):
    data = write_local_data(tmp_path / "local", ["red_circle"])
    write_local_data(tmp_path / "local", ["red_circle"])
    (data / "zebra").mkdir()
    Image.new("RGB", (8, 8)).save(data / "zebra" / "z.png")
    with pytest.raises(TrainInputError, match="unknown class 'zebra'"):
        train_local(data, edge_bundle, out=tmp_path / "updates")
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--bundle", str(edge_bundle)])
    assert out.exit_code == 2 and "'zebra'" in out.stderr and "red_circle" in out.stderr
    empty = tmp_path / "empty"
    (empty / "red_circle").mkdir(parents=True)
    out = CliRunner().invoke(main, ["train", "--data", str(empty), "--bundle", str(edge_bundle), "--json"])
    assert out.exit_code == 2 and "no images" in json.loads(out.stdout)["error"]
    assert not (tmp_path / "updates").exists()


def test_cli_train_json_no_apply(bundle_dir, tmp_path):
    data = write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    Image.new("RGB", (8, 8)).save(data / "stray.png")
    (data / "red_circle" / "broken.png").write_bytes(b"not a png")
    before = tree_bytes(bundle_dir)
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--bundle", str(bundle_dir), "--epochs", "1",
                                    "--batch-size", "2", "--out", str(tmp_path / "upd"), "--no-apply", "--json",
                                    "--threads", "1", "--lr", "0.01"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.stdout)
    assert report["ok"] and report["num_examples"] == 4 and report["personalised"] is None
    assert len(report["skipped"]) == 2 and any("broken.png" in s for s in report["skipped"])
    update = read_update(report["update"], read_bundle(bundle_dir))
    assert update.num_examples == 4 and Path(report["update"]).parent == tmp_path / "upd"
    after = tree_bytes(bundle_dir)  # --no-apply: the device keeps its LoRA; its id is kept from the first update
    assert DEVICE_ID_FILE in after and before.get(DEVICE_ID_FILE, after[DEVICE_ID_FILE]) == after[DEVICE_ID_FILE]
    assert {k: v for k, v in after.items() if k != DEVICE_ID_FILE} == \
        {k: v for k, v in before.items() if k != DEVICE_ID_FILE}


@pytest.mark.parametrize(("optimizer", "lr"), [("sgd", 0.02), ("adamw", 0.01)])
def test_each_optimizer_lowers_the_loss_and_is_recorded(edge_bundle, tmp_path, optimizer, lr):
    bundle = read_bundle(edge_bundle)
    data = write_local_data(tmp_path / "local", LOCAL_CLASSES)
    before = _dataset_loss(bundle, data, bundle.lora())
    result = train_local(data, edge_bundle, epochs=3, batch_size=6, lr=lr, optimizer=optimizer, apply=False,
                         out=tmp_path / "updates", threads=1, start="bundle")
    update = read_update(result.update_path, bundle)
    assert _dataset_loss(bundle, data, update.tensors) < before
    assert result.optimizer == update.metadata["optimizer"] == optimizer and result.to_json()["optimizer"] == optimizer


def _edit_method(source: Path, target: Path, **changes) -> Path:
    """A copy of ``source`` whose manifest's method config has ``changes`` (None deletes ``method``).

    manifest.json lists the other files' hashes, not its own, so the copy still verifies."""
    shutil.copytree(source, target)
    path = target / "manifest.json"
    manifest = json.loads(path.read_text())
    if changes.pop("drop", False):
        del manifest["method"]
    manifest.get("method", {}).update(changes)
    path.write_bytes(manifest_bytes(manifest))
    return target


def test_training_takes_alpha_from_the_manifest(edge_bundle, tmp_path):
    data = write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    edited = _edit_method(edge_bundle, tmp_path / "edited", alpha=0.5)
    assert read_bundle(edited).method["alpha"] == 0.5 and read_bundle(edge_bundle).method["alpha"] == 10.0

    def run(bundle: Path, **overrides) -> tuple:
        losses: list[float] = []
        result = train_local(data, bundle, epochs=1, batch_size=4, apply=False, start="bundle", threads=1,
                             out=tmp_path / "updates", on_step=lambda _step, loss: losses.append(loss), **overrides)
        return result, losses

    exported, exported_losses = run(edge_bundle)
    edited_result, edited_losses = run(edited)
    assert exported.alpha == 10.0 and edited_result.alpha == 0.5
    assert float(read_update(edited_result.update_path).metadata["alpha"]) == 0.5
    assert edited_losses[0] < exported_losses[0]  # same data, seed and LoRA: only the consistency weight differs
    explicit, explicit_losses = run(edited, alpha=10.0)  # an explicit alpha wins over the manifest's
    assert explicit.alpha == 10.0 and explicit_losses == pytest.approx(exported_losses, rel=1e-6)
    with pytest.raises(BundleError, match="manifest.json.*method.*re-export"):
        train_local(data, _edit_method(edge_bundle, tmp_path / "old", drop=True), out=tmp_path / "updates")


def test_train_options_hold_the_defaults_the_cli_shows():
    from fedmvp_apps.edge_cli import train as train_command

    params = {p.name: p for p in train_command.params}
    for name in ("epochs", "batch_size", "max_memory_gb", "lr", "optimizer", "alpha", "device", "seed", "threads"):
        assert params[name].default == TrainOptions.default(name), name
    assert str(params["out"].default) == str(TrainOptions.default("out"))
    assert params["epochs"].help == TrainOptions.help("epochs")
    with pytest.raises(TrainInputError, match="epochs must be a positive int"):
        TrainOptions(epochs=0)
    with pytest.raises(TypeError, match="epoch"):
        train_local("no-data", None, epoch=3)  # a misspelt option is a TypeError, as for any call


def test_unknown_optimizer_is_refused_before_training(edge_bundle, tmp_path):
    data = write_local_data(tmp_path / "local", ["red_circle"])
    with pytest.raises(TrainInputError, match="optimizer must be one of sgd, adamw"):
        train_local(data, edge_bundle, optimizer="lion", out=tmp_path / "updates")
    out = CliRunner().invoke(main, ["train", "--data", str(data), "--bundle", str(edge_bundle), "--optimizer", "lion"])
    assert out.exit_code == 2 and not (tmp_path / "updates").exists()


def test_checkpointed_segments_and_cpu_autocast(edge_bundle):
    from safetensors.torch import load_file

    bundle = read_bundle(edge_bundle)
    runner = load_program(bundle)
    assert isinstance(runner, GraphRunner) and runner.max_segments() > 4
    weights = load_file(str(bundle.file("weights")))
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2])
    grads = []
    for segments in (1, 4, runner.max_segments()):
        lora = {k: torch.from_numpy(v).requires_grad_(True) for k, v in bundle.lora().items()}
        out = runner(x, x.flip(-1), lora, weights, segments=segments)
        fedmvp_objective(*out, labels, 10.0, torch.nn.functional)["loss"].backward()
        grads.append({k: v.grad for k, v in lora.items()})
    with torch.no_grad():
        lora = {k: torch.from_numpy(v) for k, v in sorted(bundle.lora().items())}
        reference = runner.module(x, x.flip(-1), lora, dict(sorted(weights.items())))
        plain = runner(x, x.flip(-1), {k: torch.from_numpy(v) for k, v in bundle.lora().items()}, weights)
    for a, b in zip(reference, plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for other in grads[1:]:
        for k in LORA:
            torch.testing.assert_close(other[k], grads[0][k], atol=1e-6, rtol=1e-5)
    # Autocast (what CUDA uses) runs the program: the exporter's float32/CPU asserts are skipped.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        low = runner(x, x, {k: torch.from_numpy(v) for k, v in bundle.lora().items()}, weights, segments=3)
    assert low[1].dtype == torch.bfloat16 and torch.isfinite(low[1].float()).all()


def test_find_batch_size():
    per_image, fixed = 100, 1000
    assert find_batch_size(lambda b: fixed + per_image * b, cap=1000, max_bytes=fixed + per_image * 40) == 32
    assert find_batch_size(lambda b: fixed + per_image * b, cap=20, max_bytes=10**9) == 20

    def oom_above_8(b: int) -> int:
        if b > 8:
            raise MemoryError
        return 1

    assert find_batch_size(oom_above_8, cap=64, max_bytes=10**9) == 8
    with pytest.raises(TrainingError, match="max-memory-gb"):
        find_batch_size(lambda b: 10**12, cap=64, max_bytes=10**9)
