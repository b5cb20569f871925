"""`fedmvp ingest`: edge update files checked one by one, the good ones averaged into the next round.

The run is tests/run_fixtures.py's (rounds 1 and 2, tiny CLIP, LoRA rank 4). Good files are written
by edge_client.update.write_update (so the device's writer and the server's reader cannot drift);
bad ones by hand, in the same format, where the writer would refuse to make them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file

from fedmvp.federated.ingest import ingest, ingest_rules
from fedmvp.presets.server import ServerSpec
from fedmvp.run_metrics import read_metrics
from fedmvp.runs import RunDir, RunError

RUN_ID = "a" * 32
SERVER = {"max_staleness": 0, "edge_max_examples": 100}  # round 1 bundles are stale; 101 examples too many
RECORD_KEYS = {"file", "sha256", "accepted", "reason", "num_examples", "bundle_round", "bundle_id", "mean_loss",
               "device_id",
               "clipped_from", "staleness", "s", "weight", "images_digest", "base_digest", "created",
               "content_digest", "sketch", "step_norm"}


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    from tests.run_fixtures import write_run

    root = tmp_path_factory.mktemp("ingest-run")
    write_run(root / "run", root / "preset.toml", "", "ingesttest")
    PROMPTFORMERS.update({r: round_promptformer(root / "run", r) for r in RunDir(root / "run").rounds()})
    STATES.update({r: round_state(root / "run", r) for r in RunDir(root / "run").rounds()})
    from fedmvp.attributes.sentences import SentenceStyle
    from fedmvp.run_classes import RunClass, class_set, write_classes

    classes = [RunClass("x", ("a photo",), SentenceStyle(prefix="", suffix=""))]
    write_classes(root / "run", classes)  # its class set
    CLASSES.append(class_set(classes).digest)
    return root / "run"


PROMPTFORMERS: dict[int, str] = {}  # round -> the digest of its PromptFormer (what a bundle of it holds)
STATES: dict[int, str] = {}  # round -> its base digest (PromptFormer and LoRA: what a bundle of it records)
CLASSES: list[str] = []  # the run's class-set digest (what a bundle of it records)


def classes_of(run: Path) -> str | None:
    """The run's class-set digest (what a bundle of it records; None: the run records no class set)."""
    from fedmvp.run_classes import class_set

    recorded = RunDir(run).class_set()
    return class_set(recorded).digest if recorded else None


def round_state(run: Path, round_number: int) -> str:
    from fedmvp.federated.wire import to_numpy_state
    from fedmvp_formats.promptformer import state_base_digest

    return state_base_digest(to_numpy_state(dict(RunDir(run).load_checkpoint(round_number).tensors)))


def round_promptformer(run: Path, round_number: int) -> str:
    from fedmvp.federated.wire import to_numpy_state
    from fedmvp_formats.promptformer import promptformer_digest

    return promptformer_digest(to_numpy_state(dict(RunDir(run).load_checkpoint(round_number).tensors)))


def configure(run: Path, server: dict | None = None, run_id: str | None = RUN_ID) -> None:
    """The run record's run_id and [server] table, as prepare_run writes them (every key: ``server``
    names those that differ from the [server] defaults)."""
    config = RunDir(run).read_config()
    config.pop("run_id", None)
    config |= ({"run_id": run_id} if run_id else {}) | \
        ({"server": ServerSpec(**server).record()} if server is not None else {})
    RunDir(run).write_config(config)


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(base_run, target)
    configure(target, SERVER)
    return target


def lora_of(run: Path, round_number: int = 2) -> dict[str, np.ndarray]:
    tensors = RunDir(run).load_checkpoint(round_number).tensors
    return {k: v.numpy().copy() for k, v in tensors.items() if k.startswith("lora.")}


def bundle_for(folder: Path, lora: dict[str, np.ndarray], round_number: int = 2, run_id: str | None = RUN_ID,
               promptformer: str | None = None, classes: str | None = None, base: str | None = None):
    """An edge_client Bundle as `write_update` reads it: manifest.json with the source round, its state (default:
    the round's PromptFormer with ``lora``, the LoRA the bundle holds), run_id, LoRA shapes, the PromptFormer it
    holds (default: the run's round's) and its class-set digest (default: the run's)."""
    from edge_client.bundle import Bundle
    from fedmvp_formats.bundle_manifest import write_manifest

    folder.mkdir(parents=True, exist_ok=True)
    classes = classes or (CLASSES[0] if CLASSES else None)
    if base is None:  # the state of a bundle of that round: its PromptFormer and ``lora``, the LoRA it holds
        from fedmvp_formats.promptformer import base_digest

        base = base_digest(promptformer or PROMPTFORMERS.get(round_number, "0" * 64), lora)
    manifest = {"source": {"round": round_number, "base_digest": base,
                           **({"run_id": run_id} if run_id else {})},
                "lora": {"tensors": {k: list(v.shape) for k, v in lora.items()}},
                "promptformer": {"digest": promptformer or PROMPTFORMERS.get(round_number, "0" * 64)},
                "classes": {"names": ["x"], **({"digest": classes} if classes else {})}}
    write_manifest(folder, manifest)
    return Bundle(folder, manifest)


def good_update(path: Path, lora: dict[str, np.ndarray], shift: float, examples: int, loss: float,
                round_number: int = 2, run_id: str | None = RUN_ID, promptformer: str | None = None,
                classes: str | None = None, base: str | None = None, moved: dict[str, np.ndarray] | None = None,
                **extra) -> Path:
    """An update file of a bundle holding ``lora``: its values ``moved``, else ``lora`` shifted by ``shift`` times
    the tensor's place (1, 2, ...)."""
    from edge_client.update import write_update

    bundle = bundle_for(path.parent / f"bundle-{path.stem}", lora, round_number, run_id, promptformer, classes, base)
    tensors = moved if moved is not None else \
        {k: v + shift * (i + 1) for i, (k, v) in enumerate(sorted(lora.items()))}
    return write_update(path, tensors, bundle=bundle, num_examples=examples, mean_loss=loss, **extra)


def raw_update(path: Path, tensors: dict[str, np.ndarray], **meta) -> Path:
    """The update format by hand; a ``None`` value leaves the key out."""
    metadata = {"format": "fedmvp-edge-update", "format_version": "1", "bundle_id": "0" * 64, "bundle_round": "2",
                "num_examples": "10", "mean_loss": "1.0", "created": "2025-01-01T00:00:00Z", "run_id": RUN_ID}
    metadata |= {k: str(v) for k, v in meta.items()}
    save_file(tensors, str(path), metadata={k: v for k, v in metadata.items() if v != "None"})
    return path


def _nan(lora):
    bad = {k: v.copy() for k, v in lora.items()}
    next(iter(bad.values()))[0, 0] = np.nan
    return bad


def _wrong_shape(lora):
    name = next(iter(sorted(lora)))
    return {**lora, name: np.zeros((lora[name].shape[0], 3), np.float32)}


BAD = [  # (name, make(folder, lora) -> path, reason substring)
    ("nan", lambda d, lora: raw_update(d / "nan.st", _nan(lora)), "holds NaN or infinite values"),
    ("wrong-shape", lambda d, lora: raw_update(d / "shape.st", _wrong_shape(lora)), "the round's is [4, 128]"),
    ("stale", lambda d, lora: good_update(d / "stale.st", lora, 0.1, 10, 1.0, round_number=1), "stale"),
    ("newer", lambda d, lora: raw_update(d / "newer.st", lora, bundle_round=3), "newer than the run's last round 2"),
    ("truncated", lambda d, lora: _truncated(good_update(d / "trunc.st", lora, 0.2, 10, 1.0)), "truncated"),
    ("format", lambda d, lora: raw_update(d / "format.st", lora, format="other"), "not a fedmvp-edge-update"),
    ("version", lambda d, lora: raw_update(d / "version.st", lora, format_version=2), "version '2' is not supported"),
    ("zero-examples", lambda d, lora: raw_update(d / "zero.st", lora, num_examples=0), "not a positive integer"),
    ("too-many-examples", lambda d, lora: good_update(d / "many.st", lora, 0.1, 101, 1.0),
     "num_examples 101 exceeds edge_max_examples (100)"),
    ("other-run", lambda d, lora: good_update(d / "other.st", lora, 0.1, 10, 1.0, run_id="b" * 32),
     "update of another run"),
    ("non-lora", lambda d, lora: raw_update(d / "pf.st", {**lora, "promptformer.x": np.ones(2, np.float32)}),
     "non-LoRA tensors (promptformer.x)"),
    ("float16", lambda d, lora: raw_update(d / "f16.st", {k: v.astype(np.float16) for k, v in lora.items()}),
     "is not float32"),
    ("missing-metadata", lambda d, lora: raw_update(d / "meta.st", lora, created=None), "metadata lacks created"),
    ("nan-loss", lambda d, lora: raw_update(d / "loss.st", lora, mean_loss="nan"), "mean_loss 'nan'"),
    ("bad-bundle-id", lambda d, lora: raw_update(d / "id.st", lora, bundle_id="xyz"), "not a sha256"),
    ("missing-file", lambda d, lora: d / "absent.st", "cannot read"),
    # identity on content: the weights it was trained over are another run's, whatever run_id it names
    ("foreign-promptformer", lambda d, lora: good_update(d / "foreign.st", lora, 0.1, 10, 1.0, promptformer="f" * 64),
     "not over this run's round 2"),
    ("no-promptformer", lambda d, lora: raw_update(d / "nopf.st", lora), "names no PromptFormer it was trained over"),
    ("other-classes", lambda d, lora: good_update(d / "classes.st", lora, 0.1, 10, 1.0, classes="c" * 64),
     "trained on another class set"),
]


def _truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-7])
    return path


def test_only_the_good_updates_are_averaged_into_the_next_round(run, tmp_path):
    lora = lora_of(run)
    before = RunDir(run).load_checkpoint(2)
    good_a = good_update(tmp_path / "a.st", lora, 0.01, 10, 1.5)
    good_b = good_update(tmp_path / "b.st", lora, -0.02, 30, 0.5)
    bad = [make(tmp_path, lora) for _, make, _ in BAD]
    files = [good_a, *bad, good_b, good_a]  # good_a twice: the second is a duplicate
    result = ingest(run, files)

    assert result.round == 3 and result.base_round == 2
    assert [v.file for v in result.accepted] == [str(good_a), str(good_b)]
    reasons = [v.reason for v in result.rejected]
    for (name, _, expected), reason in zip(BAD + [("dup", None, "duplicate")], reasons, strict=True):
        assert expected in reason, (name, reason)
    assert "given earlier in this command" in reasons[-1]

    after = RunDir(run).load_checkpoint(3)
    a, b = (lora_of_file(p) for p in (good_a, good_b))
    for name in lora:  # FedAvg weighted by examples, over exactly the two good files
        expected = (10 * a[name].astype(np.float64) + 30 * b[name].astype(np.float64)) / 40
        np.testing.assert_allclose(after.tensors[name].numpy(), expected, rtol=0, atol=1e-6)
        assert not np.allclose(after.tensors[name].numpy(), lora[name])
    assert set(after.tensors) == set(before.tensors)
    for name in (k for k in before.tensors if not k.startswith("lora.")):  # the PromptFormer, bit for bit
        assert torch.equal(after.tensors[name], before.tensors[name]), name

    state = after.state
    assert set(before.state) - {"complete", "round"} <= set(state)
    assert state["method"] == before.state["method"] and state["lora_clients"] == before.state["lora_clients"]
    assert state["source"] == "ingest" and state["ingested_onto"] == 2
    assert state["ingest_rules"] == {"max_staleness": 0, "edge_max_examples": 100, "count_cap": 3.0,
                                     "max_update_norm": None, "max_update_rms": 10.0,
                                     "update_norm_action": "reject", "staleness_exponent": 0.5, "server_lr": 1.0,
                                     "device_rule": None}
    assert [r["file"] for r in state["ingest"]] == [str(f) for f in files]
    assert all(set(r) == RECORD_KEYS for r in state["ingest"])
    assert [r["accepted"] for r in state["ingest"]] == [True] + [False] * len(bad) + [True, False]
    record = state["ingest"][0]
    assert (record["num_examples"], record["bundle_round"], record["mean_loss"]) == (10, 2, 1.5)
    assert len(record["bundle_id"]) == 64 and len(record["sha256"]) == 64
    row = {"round": 3, "source": "ingest", "updates": 2, "examples": 40, "train_loss": (10 * 1.5 + 30 * 0.5) / 40}
    assert read_metrics(RunDir(run))[-1] == row and state["metrics"] == row

    # fedmvp-export rebuilds the model from the round's own method record (export/run_inputs.py).

    assert RunDir(run).method(after).to_dict() == before.state["method"]

    again = ingest(run, [good_a])  # accepted in round 3: a second command refuses it too, writes nothing
    assert again.round is None and "duplicate: the same file was accepted in round 3" in again.files[0].reason
    assert RunDir(run).rounds() == [1, 2, 3]


def lora_of_file(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def test_nothing_accepted_writes_nothing(run, tmp_path):
    lora = lora_of(run)
    metrics = (run / "metrics.jsonl").read_bytes() if (run / "metrics.jsonl").exists() else None
    result = ingest(run, [raw_update(tmp_path / "nan.st", _nan(lora))])
    assert result.round is None and RunDir(run).rounds() == [1, 2]
    assert ((run / "metrics.jsonl").read_bytes() if (run / "metrics.jsonl").exists() else None) == metrics


def test_an_interrupted_ingest_leaves_no_half_round(run, tmp_path, monkeypatch):
    from fedmvp import atomic

    good = good_update(tmp_path / "a.st", lora_of(run), 0.01, 10, 1.0)
    real = atomic.write_json

    def failing(path, obj):
        if Path(path).name == "state.json":  # global.safetensors is already written by now
            raise KeyboardInterrupt
        real(path, obj)

    monkeypatch.setattr(atomic, "write_json", failing)
    with pytest.raises(KeyboardInterrupt):
        ingest(run, [good])
    assert RunDir(run).rounds() == [1, 2]
    assert sorted(p.name for p in run.iterdir() if "0003" in p.name) == []  # no folder, no temp folder
    assert not (run / "metrics.jsonl").exists() or all(r["round"] != 3 for r in read_metrics(RunDir(run)))
    monkeypatch.setattr(atomic, "write_json", real)
    assert ingest(run, [good]).round == 3  # the file was not recorded as accepted: it counts now


@pytest.mark.parametrize("server, override, accepted", [
    ({"max_staleness": 0}, None, False),
    ({"max_staleness": 1}, None, True),
    ({"max_staleness": 0}, 1, True),  # --max-staleness overrides the run record
    ({}, None, True),  # default 5
])
def test_max_staleness_decides_whether_an_old_bundle_counts(run, tmp_path, server, override, accepted):
    configure(run, server)
    old = good_update(tmp_path / "old.st", lora_of(run), 0.01, 10, 1.0, round_number=1)
    result = ingest(run, [old], max_staleness=override)
    assert (result.round == 3) is accepted, result.files[0].reason
    if accepted:
        assert RunDir(run).load_checkpoint(3).state["ingest_rules"]["max_staleness"] == \
            (override if override is not None else server.get("max_staleness", ServerSpec().max_staleness))


@pytest.mark.parametrize("limit, accepted", [(100, False), (101, True), (None, True)])
def test_edge_max_examples_bounds_an_updates_weight(run, tmp_path, limit, accepted):
    configure(run, {} if limit is None else {"edge_max_examples": limit})  # None: default 10000
    result = ingest(run, [good_update(tmp_path / "u.st", lora_of(run), 0.01, 101, 1.0)])
    assert (result.round == 3) is accepted, result.files[0].reason


@pytest.mark.parametrize("server, outcome", [
    ({}, "kept"), ({"max_update_norm": 1e-3}, "rejected"),
    ({"max_update_norm": 1e-3, "update_norm_action": "clip"}, "clipped"),
])
def test_max_update_norm_rejects_or_clips_a_large_update(run, tmp_path, server, outcome):
    configure(run, server)
    lora = lora_of(run)
    result = ingest(run, [good_update(tmp_path / "u.st", lora, 0.05, 10, 1.0)])
    verdict = result.files[0]
    if outcome == "rejected":
        assert result.round is None and "exceeds the bound 0.001" in verdict.reason
        return
    after = lora_of(run, 3)
    norm = np.sqrt(sum(np.sum((after[k].astype(np.float64) - lora[k]) ** 2) for k in lora))
    if outcome == "clipped":
        assert verdict.clipped_from > 1e-3 and norm == pytest.approx(1e-3, rel=1e-3)
        assert RunDir(run).load_checkpoint(3).state["ingest"][0]["clipped_from"] == verdict.clipped_from
    else:
        assert verdict.clipped_from is None and norm > 0.1


def test_run_id_is_checked_only_when_the_update_names_one(run, tmp_path):
    lora = lora_of(run)
    without = good_update(tmp_path / "anon.st", lora, 0.01, 10, 1.0, run_id=None)
    assert ingest(run, [without]).round == 3
    configure(run, SERVER, run_id=None)  # a run that records no run_id cannot vouch for an update naming one
    named = ingest(run, [good_update(tmp_path / "named.st", lora, 0.02, 10, 1.0, round_number=3)])
    assert named.round is None and "update of another run" in named.files[0].reason


def test_preset_server_keys_reach_the_ingest_rules(preset_file, tmp_path):
    from fedmvp.federated.prepare import prepare_run

    preset_file.write_text(preset_file.read_text() + "\n[server]\nmax_staleness = 2\nedge_max_examples = 7\n"
                           "max_update_norm = 0.5\nupdate_norm_action = \"clip\"\n")
    run = prepare_run(str(preset_file), str(tmp_path / "r"), None, False, "cpu", with_data=False)
    rules = ingest_rules(run, run.read_config(), 4)
    assert rules.server == ServerSpec(max_staleness=2, edge_max_examples=7, max_update_norm=0.5,
                                      update_norm_action="clip")
    assert rules.run_id == run.read_config()["run_id"] and rules.round == 4
    assert ingest_rules(run, run.read_config(), 4, max_staleness=9).server.max_staleness == 9
    with pytest.raises(RunError, match="--max-staleness: server max_staleness must be 0 or more, got -1"):
        ingest_rules(run, run.read_config(), 4, max_staleness=-1)


def test_an_older_server_record_is_migrated_with_a_warning(run, tmp_path, capsys):
    """docs/architecture.md, Migrations: a record lacking keys (a run of an older fedmvp) gets the [server]
    defaults for exactly those keys, and the reader says so; a record out of range is refused."""
    config = RunDir(run).read_config()
    config["server"] = {"max_staleness": 0}
    RunDir(run).write_config(config)
    assert RunDir(run).server() == ServerSpec(max_staleness=0)
    warning = capsys.readouterr().err
    assert "config.json: the server record lacks min_nodes" in warning and "max_staleness" not in warning
    config["server"] = {**ServerSpec().record(), "edge_max_examples": 0}
    RunDir(run).write_config(config)
    with pytest.raises(RunError, match="server edge_max_examples must be at least 1, got 0"):
        ingest(run, [good_update(tmp_path / "u.st", lora_of(run), 0.01, 10, 1.0)])


def test_bad_runs_are_refused_before_anything_is_read(tmp_path, run):
    with pytest.raises(RunError, match="not a fedmvp run"):
        ingest(tmp_path / "nowhere", [tmp_path / "x.st"])
    with pytest.raises(RunError, match="no update files"):
        ingest(run, [])
    empty = tmp_path / "empty"
    empty.mkdir()
    RunDir(empty).write_config({"run_id": RUN_ID})
    with pytest.raises(RunError, match="no complete round"):
        ingest(empty, [tmp_path / "x.st"])


# ---- the command ---------------------------------------------------------------------------------------
def invoke(*args: str):
    from fedmvp_apps.cli import main

    return CliRunner().invoke(main, ["ingest", *args])


def test_cli_exit_codes_table_and_json(run, tmp_path):
    lora = lora_of(run)
    good = good_update(tmp_path / "good.st", lora, 0.01, 10, 1.0)
    bad = raw_update(tmp_path / "nan.st", _nan(lora))

    result = invoke("--run", str(run), str(bad))
    assert result.exit_code == 1, result.output
    assert "nan.st" in result.output and "rejected" in result.output and "nothing written" in result.output

    result = invoke("--run", str(run), "--json", str(good), str(bad))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["round"] == 3 and [r["file"] for r in report["accepted"]] == [str(good)]
    assert [(r["file"], "NaN" in r["reason"]) for r in report["rejected"]] == [(str(bad), True)]

    result = invoke("--run", str(run), str(good))  # the table; already accepted: a duplicate, exit 1
    assert result.exit_code == 1 and "duplicate" in result.output

    old = good_update(tmp_path / "old.st", lora, 0.02, 10, 1.0, round_number=2)  # round 3 now; max_staleness 0
    assert invoke("--run", str(run), str(old)).exit_code == 1
    result = invoke("--run", str(run), "--max-staleness", "1", str(old))
    assert result.exit_code == 0 and "round 4 written" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["--run", "{tmp}/nowhere", "{tmp}/u.st"], "{tmp}/nowhere: not a fedmvp run (no config.json)"),
    (["--run", "{run}"], "{run}: no update files given"),
    (["--run", "{run}", "--max-staleness", "-1", "{tmp}/u.st"], "Invalid value for '--max-staleness'"),
])
def test_cli_bad_input_is_one_line_and_exit_2(run, tmp_path, args, message):
    result = invoke(*[a.format(tmp=tmp_path, run=run) for a in args])
    assert result.exit_code == 2, result.output
    assert message.format(tmp=tmp_path, run=run) in result.output and "Traceback" not in result.output
    if "--max-staleness" not in args:
        assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: ")


def test_two_updates_over_the_same_images_count_their_examples_once(run, tmp_path):
    """One device trained twice on the same images (two `edge-client train` files, the same
    images_digest): the round counts its examples once, the newer update kept, the older one line."""
    lora = lora_of(run)
    same = "d" * 64
    older = good_update(tmp_path / "older.st", lora, 0.01, 10, 1.0, images_digest=same, created="2026-01-01T00:00:00")
    newer = good_update(tmp_path / "newer.st", lora, 0.02, 10, 1.0, images_digest=same, created="2026-01-02T00:00:00")
    other = good_update(tmp_path / "other.st", lora, 0.03, 5, 1.0, images_digest="e" * 64)
    result = invoke("--run", str(run), "--json", str(newer), str(other), str(older))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["examples"] == 15 and sorted(r["file"] for r in report["accepted"]) == [str(newer), str(other)]
    (rejected,) = report["rejected"]
    assert rejected["file"] == str(older) and rejected["reason"].startswith(f"same images as {newer} (images_digest "
                                                                            f"dddddddddddd), which is newer")
    assert read_metrics(RunDir(run))[-1]["examples"] == 15


def test_an_images_digest_that_is_no_sha256_is_refused(run, tmp_path):
    bad = raw_update(tmp_path / "digest.st", lora_of(run), images_digest="xyz")
    assert "images_digest 'xyz' is not a sha256" in ingest(run, [bad]).rejected[0].reason


def test_the_images_digest_is_of_the_images_not_their_order():
    """What a device writes (edge_client.local_data.images_digest): the same images in another order give
    the same digest; another class for one image, or one image fewer, another."""
    from edge_client.local_data import images_digest

    pixels = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), dtype=np.uint8)
    labels = np.array([0, 0, 1, 1])
    digest = images_digest(pixels, labels)
    assert images_digest(pixels[::-1], labels[::-1]) == digest
    assert images_digest(pixels, np.array([0, 1, 1, 1])) != digest != images_digest(pixels[:3], labels[:3])
