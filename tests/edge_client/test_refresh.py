"""Bundle refresh: a round-1 bundle moved in place to round 2's PromptFormer is the round-2 bundle;
refusals change nothing; a crash at any rename recovers; rollback gives back the old bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from edge_helpers import preprocess_batch, tree_bytes
from PIL import Image
from safetensors.numpy import load_file

from edge_client import journal
from edge_client.bundle import BundleError, read_bundle
from fedmvp_apps.edge_cli import main
from edge_client.infer import Predictor
from edge_client.lora_store import active_lora, apply_update
from edge_client.refresh import promptformer_digest, recover_refresh, refresh_bundle, restore_previous
from edge_client.update import write_update
from fedmvp_formats.bundle_manifest import REFRESH_NEW, REFRESH_SCRATCH, write_manifest


@pytest.fixture(scope="module")
def round2(moved_run) -> dict[str, np.ndarray]:
    """Round 2's global tensors as the server sends them (promptformer.* and lora.*)."""
    return load_file(str(moved_run / "round-0002" / "global.safetensors"))


@pytest.fixture(scope="module")
def images(data_root) -> list[Path]:
    """One test image of each of four classes."""
    return [sorted(folder.glob("*.png"))[0] for folder in sorted((data_root / "test").iterdir())[:4]]


@pytest.fixture
def stale(moved_bundles, tmp_path) -> Path:
    """A private copy of the round-1 bundle (the device's, one round behind)."""
    target = tmp_path / "bundle"
    shutil.copytree(moved_bundles[1], target)
    return target


def _promptformer(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v for k, v in tensors.items() if k.startswith("promptformer.")}


def _logits(bundle: Path, images: list[Path]) -> np.ndarray:
    predictor = Predictor(bundle, provider="cpu")
    return predictor.run(preprocess_batch([Image.open(p) for p in images], predictor.spec))["logits"]


def test_refreshed_round1_bundle_is_the_round2_bundle(stale, moved_bundles, round2, images):
    target = read_bundle(moved_bundles[2])
    before, old = _logits(stale, images), read_bundle(stale)
    old_id = old.id  # Bundle.id reads manifest.json: after the refresh it is the new one
    assert old.refreshable and old.round == 1 and old.manifest["source"]["run_id"] == "moved-run-0"
    assert old.promptformer_digest != target.promptformer_digest == promptformer_digest(round2)

    result = refresh_bundle(old, round2, digest=promptformer_digest(round2), round_number=2, check_images=images)
    new = read_bundle(stale)  # verifies every hash
    assert (result.old_id, result.new_id, result.round) == (old_id, new.id, 2) and new.id != old_id
    assert result.bytes_received == sum(v.nbytes for v in round2.values())
    assert result.images_checked == 4 and result.parity_max_abs_diff <= 1e-3
    weights, expected = load_file(str(stale / "weights.safetensors")), load_file(str(target.file("weights")))
    assert sorted(weights) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(weights[name], expected[name], atol=1e-5, err_msg=name)
    data = (stale / "weights.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")  # patched in place: the header (offsets) is unchanged
    assert data[:header] == (moved_bundles[1] / "weights.safetensors").read_bytes()[:header]
    for name in ("model.onnx", "lora.safetensors"):  # the global LoRA, embedded in the ONNX model too
        assert (stale / name).read_bytes() == (target.path / name).read_bytes(), name
    after = _logits(stale, images)
    np.testing.assert_allclose(after, _logits(target.path, images), atol=1e-4)
    assert np.abs(after - before).max() > 0.05
    assert new.round == 2 and new.manifest["source"]["refreshed_from"] == old_id
    assert new.promptformer_digest == target.promptformer_digest
    previous = stale / "previous"
    assert sorted(p.name for p in previous.iterdir()) == ["lora.safetensors", "manifest.json", "model.onnx",
                                                          "weights.safetensors"]
    assert all((previous / p.name).read_bytes() == p.read_bytes() for p in moved_bundles[1].iterdir()
               if (previous / p.name).exists())
    assert not any((stale / name).exists() for name in (*REFRESH_SCRATCH, "refresh.json"))


def _nan(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    value = tensors["promptformer.block.attn.to_k.weight"].copy()
    value[0, 0] = np.nan
    return {**tensors, "promptformer.block.attn.to_k.weight": value}


# name -> (tensors from round 2's, digest: None = the tensors' own, what the one-line error says)
REFUSALS = {
    "digest mismatch": (lambda t: t, "0" * 64, "announced digest"),
    "wrong shape": (lambda t: {**t, "promptformer.text_proj.weight": t["promptformer.text_proj.weight"][:, :-1]},
                    None, "promptformer.text_proj.weight: shape"),
    "NaN": (_nan, None, "NaN or infinite"),
    "missing": (lambda t: {k: v for k, v in t.items() if k != "promptformer.block.attn.to_v.bias"}, None,
                "missing promptformer.block.attn.to_v.bias"),
    "extra": (lambda t: {**t, "promptformer.block.extra.weight": np.ones(3, np.float32)}, None,
              "unknown PromptFormer tensors promptformer.block.extra.weight"),
    "stray": (lambda t: {**t, "visual.proj": np.ones(3, np.float32)}, None, "unexpected tensors visual.proj"),
    "integers": (lambda t: {**t, "promptformer.block.norm_query.bias": np.ones(128, np.int64)}, None,
                 "is int64, not a float tensor"),
    "LoRA names": (lambda t: {k: v for k, v in t.items() if k != "lora.block.attn.to_q.lora_A.weight"}, None,
                   "LoRA tensors are not the bundle's"),
    "LoRA shape": (lambda t: {**t, "lora.block.attn.to_q.lora_A.weight": t["lora.block.attn.to_q.lora_A.weight"][:3]},
                   None, "lora.block.attn.to_q.lora_A.weight: shape"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_tensors_leave_the_bundle_byte_identical(case, stale, round2):
    change, digest, says = REFUSALS[case]
    tensors = change(dict(round2))
    before = tree_bytes(stale)
    with pytest.raises(BundleError) as info:
        refresh_bundle(read_bundle(stale), tensors, digest=digest or promptformer_digest(tensors), round_number=2)
    message = str(info.value)
    assert says in message and str(stale) in message and "\n" not in message
    assert tree_bytes(stale) == before and sorted(p.name for p in stale.iterdir()) == sorted(before)


# name -> (how the manifest is changed, what the refusal says)
NOT_REFRESHABLE = {
    "exported before refresh support": (lambda m: m.pop("promptformer"), "exported before refresh support"),
    "fp16": (lambda m: m.update(precision="fp16"), "only fp32 bundles"),
    "inference only": (lambda m: (m["files_by_role"].pop("training"), m.get("requires", {}).pop("training", None)),
                       "exported for inference only"),
}


@pytest.mark.parametrize("case", sorted(NOT_REFRESHABLE))
def test_bundles_that_cannot_be_refreshed_say_why(case, stale, round2):
    change, says = NOT_REFRESHABLE[case]
    manifest = read_bundle(stale).manifest
    change(manifest)
    write_manifest(stale, manifest)
    bundle = read_bundle(stale)
    before = tree_bytes(stale)
    assert not bundle.refreshable and says in bundle.refresh_blocker()
    with pytest.raises(BundleError, match=says):
        refresh_bundle(bundle, round2, digest=promptformer_digest(round2), round_number=2)
    assert tree_bytes(stale) == before


def test_a_parity_failure_refuses_the_refresh(stale, round2, images, monkeypatch):
    from edge_client import refresh_check

    real = refresh_check._program_logits
    monkeypatch.setattr(refresh_check, "_program_logits", lambda *a: real(*a) + np.eye(real(*a).shape[-1])[0] * 50)
    before = tree_bytes(stale)
    with pytest.raises(BundleError, match=r"disagree on 4 images \(max \|logit diff\| 5\.0+e\+01.*top-1"):
        refresh_bundle(read_bundle(stale), round2, digest=promptformer_digest(round2), round_number=2,
                       check_images=images)
    assert tree_bytes(stale) == before


class Crash(BaseException):
    """A kill: nothing catches it."""


def test_a_crash_at_any_rename_recovers_to_the_old_or_the_new_bundle(stale, round2, monkeypatch):
    """os.replace fails at its 1st, 2nd, ... call of a refresh (PromptFormer only, no images: fast)."""
    tensors = _promptformer(round2)
    original, old_id = tree_bytes(stale), read_bundle(stale).id
    real_replace = os.replace
    outcomes: list[str] = []
    for fail_at in range(1, 100):
        calls = {"n": 0}

        def replace(src, dst, fail_at=fail_at, calls=calls):
            calls["n"] += 1
            if calls["n"] == fail_at:
                raise Crash(f"killed at os.replace #{fail_at}")
            return real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            result = refresh_bundle(read_bundle(stale), tensors, digest=promptformer_digest(tensors), round_number=2)
        except Crash:
            monkeypatch.setattr(os, "replace", real_replace)
        else:
            monkeypatch.setattr(os, "replace", real_replace)
            break
        if (stale / "refresh.json").exists():
            try:
                read_bundle(stale)
            except BundleError as err:  # a reader is told what finishes it
                assert "recover_refresh" in str(err)
        recover_refresh(stale)
        bundle = read_bundle(stale)  # verifies: the old bundle or the new one, nothing in between
        assert not any((stale / name).exists() for name in (*REFRESH_SCRATCH, "refresh.json"))
        outcomes.append("old" if bundle.id == old_id else bundle.id)
        if bundle.id != old_id:
            restore_previous(stale)
        assert tree_bytes(stale) == original
    assert {o for o in outcomes if o != "old"} == {result.new_id}  # every finished one is the same refresh
    assert outcomes.count("old") >= 3 and len(outcomes) - outcomes.count("old") >= 10
    assert read_bundle(stale).id == result.new_id and (stale / "previous" / "lora.safetensors").is_file()


@pytest.mark.parametrize("fail_at,says", [(1, "cannot stage the refresh"), (8, "recover_refresh completes it")])
def test_a_disk_error_is_one_line_and_recoverable(fail_at, says, stale, round2, monkeypatch):
    """An OSError while staging leaves the bundle as it was; one while renaming says what completes it."""
    real_replace, calls = os.replace, {"n": 0}

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    old_id = read_bundle(stale).id
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(BundleError, match=says) as info:
        refresh_bundle(read_bundle(stale), round2, digest=promptformer_digest(round2), round_number=2)
    monkeypatch.setattr(os, "replace", real_replace)
    assert "No space left" in str(info.value) and "\n" not in str(info.value)
    assert recover_refresh(stale) == (None if fail_at == 1 else "refresh")
    assert (read_bundle(stale).id == old_id) == (fail_at == 1)


def test_staged_leftovers_without_a_journal_are_dropped(stale):
    before = tree_bytes(stale)
    journal.start_scratch(stale)
    (stale / REFRESH_NEW / "weights.safetensors").write_bytes(b"half written")
    (stale / ".refresh.json.abc.tmp").write_bytes(b"{")
    assert recover_refresh(stale) is None
    assert tree_bytes(stale) == before and sorted(p.name for p in stale.iterdir()) == sorted(before)


def test_personalisation_moves_to_previous_and_rollback_restores_every_byte(stale, round2, tmp_path):
    bundle = read_bundle(stale)
    lora = {k: v + 0.01 for k, v in bundle.lora().items()}
    apply_update(bundle, write_update(tmp_path / "u.safetensors", lora, bundle=bundle, num_examples=1, mean_loss=1.0))
    original, old_id = tree_bytes(stale), bundle.id
    refresh_bundle(bundle, round2, digest=promptformer_digest(round2), round_number=2)
    assert not (stale / "personalised").exists() and (stale / "previous" / "personalised" / "state.json").is_file()
    assert active_lora(read_bundle(stale)).source == "bundle"  # trained over the old PromptFormer: not run

    runner = CliRunner()
    both = runner.invoke(main, ["rollback", "--refresh", "--all", "--bundle", str(stale), "--json"])
    assert both.exit_code == 2 and "cannot be combined" in json.loads(both.stdout)["error"]
    done = runner.invoke(main, ["rollback", "--refresh", "--bundle", str(stale), "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert report["ok"] and report["bundle_id"] == old_id and report["round"] == 1
    assert tree_bytes(stale) == original
    assert active_lora(read_bundle(stale)).source == "personalised"
    again = runner.invoke(main, ["rollback", "--refresh", "--bundle", str(stale)])
    assert again.exit_code == 1 and "nothing to roll back" in again.stderr


def test_a_tampered_previous_bundle_is_not_restored(stale, round2):
    refresh_bundle(read_bundle(stale), round2, digest=promptformer_digest(round2), round_number=2)
    before = tree_bytes(stale)
    weights = stale / "previous" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(BundleError, match="previous/weights.safetensors: does not match"):
        restore_previous(stale)
    assert read_bundle(stale).round == 2 and tree_bytes(stale).keys() == before.keys()


def test_a_second_refresh_keeps_one_previous_generation(stale, round2):
    first = refresh_bundle(read_bundle(stale), _promptformer(round2), digest=promptformer_digest(round2),
                           round_number=2)
    second = refresh_bundle(read_bundle(stale), round2, digest=promptformer_digest(round2), round_number=3)
    assert read_bundle(stale).manifest["source"]["refreshed_from"] == first.new_id == second.old_id
    assert json.loads((stale / "previous" / "manifest.json").read_text())["source"]["refreshed_from"] == first.old_id
    assert restore_previous(stale).id == first.new_id and not (stale / "previous").exists()


@pytest.mark.parametrize("personalise", [True, False])
def test_a_refresh_during_join_says_what_became_of_the_personalised_lora(stale, round2, images, tmp_path,
                                                                        personalise):
    """`edge-client join --personalise` ends with a personalised LoRA: a refresh moves the device's aside
    (trained over the old PromptFormer), and the node re-applies it on the refreshed bundle, saying so in
    one line; without --personalise the line says where it went and the round's LoRA runs."""
    from edge_client.node import EdgeNodeConfig, sync_bundle

    old = read_bundle(stale)
    lora = {k: v + 0.01 for k, v in old.lora().items()}
    apply_update(old, write_update(tmp_path / "mine.safetensors", lora, bundle=old, num_examples=6, mean_loss=0.5))
    node = EdgeNodeConfig(bundle=stale, data=tmp_path, personalise=personalise)
    synced = sync_bundle(node, round2, promptformer_digest(round2), 2, images)
    assert synced.refreshed and synced.personal.startswith("edge: the refresh to round 2 moved the personalised "
                                                           f"LoRA aside ({stale}/previous/personalised/lora-0001")
    active = active_lora(read_bundle(stale))
    assert active.personalised == personalise
    if personalise:
        assert "re-applied on the refreshed bundle as lora-0001.safetensors (--personalise)" in synced.personal
        assert all(np.array_equal(active.tensors[k], lora[k]) for k in lora)
    else:
        assert "edge-client rollback --refresh brings it back" in synced.personal


def test_a_refresh_from_another_run_names_that_run_and_its_updates_carry_its_weights(stale, round2, tmp_path):
    """Identity follows the weights: a bundle of run A refreshed to run B's round names run B (and the run it
    came from), atomically with the new weights, and an update trained on it says both the run and the
    PromptFormer it was trained over (what `fedmvp ingest` checks on content)."""
    from edge_client.update import read_update

    old = read_bundle(stale)
    assert old.run_id == "moved-run-0"
    refresh_bundle(old, round2, digest=promptformer_digest(round2), round_number=2, run_id="run-b")
    new = read_bundle(stale)
    assert (new.run_id, new.round, new.manifest["source"]["refreshed_from_run"]) == ("run-b", 2, "moved-run-0")
    update = read_update(write_update(tmp_path / "u.st", new.lora(), bundle=new, num_examples=3, mean_loss=1.0), new)
    assert update.metadata["run_id"] == "run-b" and update.round == 2
    assert update.metadata["promptformer_digest"] == promptformer_digest(round2) == new.promptformer_digest
    assert update.metadata["classes_digest"] == new.classes_digest is not None
    restore_previous(stale)  # a rollback brings back the old identity with the old weights
    assert read_bundle(stale).run_id == "moved-run-0"
