"""The edge bundle crosses the server -> device trust boundary: every file of it, tried as an attacker would.

One row per attack: a real exported bundle is copied, one file (and, where the attacker would, the
manifest) is made hostile, a user-facing command runs on it (infer, train, info, join, rollback
--refresh), and the row checks the exit code (2: bad input), one error line naming the file and the
problem, no traceback, and that neither the bundle nor the attacker's target outside it (``outside/``)
changed. Most rows run in this process (tests/hostile/disk.py `run`); the pickle row also runs the
real ``edge-client train`` script and checks its payload's marker file never appears.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk import Hostile, assert_one_line_error, run, tree_digest  # noqa: E402
from edge_helpers import REPO, class_image, write_local_data  # noqa: E402
from forge import (PROGRAM_PREFIX, SAFETENSORS_ATTACKS, declare_size, deflated_blob, payload,  # noqa: E402
                   pickled_weight_config, program_entries, relocate_external, replace_entry, resign,
                   resign_personalised, tamper_safetensors, write_program)

INFER = ["infer", "img.jpg"]
TRAIN = ["train", "--data", "local", "--epochs", "1", "--batch-size", "4", "--out", "updates"]
INFO = ["info"]
JOIN = ["join", "--superlink", "nohost", "--insecure", "--data", "local"]  # a bad address: never starts Flower
COMMANDS = {"infer": INFER, "train": TRAIN, "info": INFO, "join": JOIN, "rollback": ["rollback", "--refresh"]}
Setup = Callable[[Path], None]
SETUPS: dict[str, Setup] = {}
ROWS: list[Hostile] = []
REAL_PROCESS: set[str] = set()  # rows that run the console script in a fresh interpreter


def row(id: str, command: str, fragment: str, setup: Setup) -> None:
    """One table row: the attack ``setup`` makes, the command run on it, the line expected back."""
    ROWS.append(Hostile(id, COMMANDS[command], 2, fragment, ["bundle", "outside"]))
    SETUPS[id] = setup


def _sha(path: Path) -> dict:
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _manifest(root: Path, change: Callable[[dict], None]) -> None:
    path = root / "bundle" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# ---- 1: the manifest names files outside the bundle ------------------------------------------------------
def _listed(name: str, target: Callable[[Path], Path], role: str | None = None) -> Setup:
    """The manifest lists ``name`` (hashed as ``target`` is, so the hashes would match), maybe for ``role``;
    consistently, as an attacker who writes the manifest would (its ``requires`` row names the file too)."""
    def setup(root: Path) -> None:
        entry = _sha(target(root))

        def edit(m: dict) -> None:
            m["files"][name] = entry
            if role:
                m["files_by_role"][role] = name
                if role in m.get("requires", {}):
                    m["requires"][role]["file"] = name
        _manifest(root, edit)
    return setup


def _secret(root: Path) -> Path:
    return root / "outside" / "secret.bin"


def _passwd(root: Path) -> Path:
    return Path("/etc/passwd") if Path("/etc/passwd").is_file() else _secret(root)


def _literal_backslash(root: Path) -> None:
    """A file whose name holds backslashes (a path on Windows), present in the bundle, hashes right."""
    name = "..\\outside\\secret.bin"
    shutil.copyfile(_secret(root), root / "bundle" / name)
    _listed(name, _secret)(root)


row("name-parent", "infer", "manifest.json: | file name '../outside/secret.bin'",
    _listed("../outside/secret.bin", _secret))
row("name-etc", "infer", "manifest.json: | file name '../../etc/passwd'", _listed("../../etc/passwd", _passwd))
row("name-absolute", "train", "manifest.json: | file name '/etc/passwd'", _listed("/etc/passwd", _passwd))
row("name-absolute-tmp", "info", "manifest.json: | file name '/",
    lambda root: _listed(str(_secret(root)), _secret)(root))
row("name-backslash", "infer", "manifest.json: | file name '..\\\\outside\\\\secret.bin'", _literal_backslash)
row("name-nul", "join", "manifest.json: | file name 'secret\\x00.bin'", _listed("secret\x00.bin", _secret))
row("name-dot-slash", "train", "manifest.json: | file name './model.onnx'",
    _listed("./model.onnx", lambda root: root / "bundle" / "model.onnx", role="onnx"))
row("role-outside", "infer", "manifest.json: | file name '../outside/lora.safetensors'",
    _listed("../outside/lora.safetensors", lambda root: root / "outside" / "lora.safetensors", role="lora"))


# ---- 2: files and directories of the bundle that are symlinks ---------------------------------------------
def _link(name: str, target: str) -> Setup:
    """bundle/``name`` replaced by a symlink to outside/``target`` (a byte-identical copy: hashes match)."""
    def setup(root: Path) -> None:
        path = root / "bundle" / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        path.symlink_to(root / "outside" / target)
    return setup


def _previous_link(root: Path) -> None:
    """previous/ -> outside/old, which holds what `rollback --refresh` would move into the bundle."""
    old = root / "outside" / "old"
    old.mkdir()
    shutil.copyfile(root / "bundle" / "manifest.json", old / "manifest.json")
    shutil.copyfile(root / "bundle" / "model.onnx", old / "model.onnx")
    (root / "bundle" / "previous").symlink_to(old)


for _file, _command in (("model.onnx", "infer"), ("model.onnx", "train"), ("model.onnx", "info"),
                        ("weights.safetensors", "infer"), ("weights.safetensors", "train"),
                        ("train.pt2", "train"), ("lora.safetensors", "join")):
    row(f"link-{_file}-{_command}", _command, f"{_file}: | symbolic link", _link(_file, _file))
row("link-personalised-train", "train", "personalised: | symbolic link", _link("personalised", "victim"))
row("link-personalised-infer", "infer", "personalised: | symbolic link", _link("personalised", "victim"))
row("link-previous-rollback", "rollback", "previous: | symbolic link", _previous_link)


def _journal_through_link(root: Path) -> None:
    """A refresh journal shipped with the bundle whose step reaches outside through personalised/ -> outside/victim."""
    _link("personalised", "victim")(root)
    (root / "bundle" / "refresh.json").write_text(json.dumps({
        "format": "fedmvp-edge-refresh-journal", "format_version": 1, "kind": "refresh", "done": 0,
        "moves": [["personalised/notes.txt", "stolen.txt"]]}))


row("journal-through-link-join", "join", "refresh.json: | malformed step", _journal_through_link)


# ---- 3: model.onnx reads external data from outside the bundle ---------------------------------------------
def _external(location: Callable[[Path], str]) -> Setup:
    def setup(root: Path) -> None:
        shutil.copyfile(root / "outside" / "secret.bin", root / "bundle" / "extra.bin")  # unlisted, inside
        relocate_external(root / "bundle" / "model.onnx", location(root))
        resign(root / "bundle", "model.onnx")
    return setup


for _id, _location in (("parent", lambda root: "../outside/secret.bin"), ("absolute", lambda root: str(_secret(root))),
                       ("unlisted", lambda root: "extra.bin"), ("backslash", lambda root: "..\\outside\\secret.bin")):
    for _command in ("infer", "train") if _id in ("parent", "absolute") else ("infer",):
        row(f"onnx-external-{_id}-{_command}", _command, "model.onnx: | external data", _external(_location))


# ---- 4, 5: train.pt2 carrying pickles, odd entry names, zip bombs ------------------------------------------
CONFIG = PROGRAM_PREFIX + "data/weights/model_weights_config.json"
MODEL_JSON = PROGRAM_PREFIX + "models/model.json"


def _program(change: Callable[[list[tuple[str, bytes]], Path], list[tuple[str, bytes]]],
             compress: dict[str, int] | None = None, declared: tuple[str, int] | None = None) -> Setup:
    def setup(root: Path) -> None:
        path = root / "bundle" / "train.pt2"
        write_program(path, change(program_entries(path), root / "outside" / "marker"), compress)
        if declared:
            declare_size(path, *declared)
        resign(root / "bundle", "train.pt2")
    return setup


def _pickled_weight(entries: list, marker: Path) -> list:
    return [*replace_entry(entries, CONFIG, pickled_weight_config()), (PROGRAM_PREFIX + "data/weights/weight_0",
                                                                       payload(marker))]


def _added(name: str) -> Callable[[list, Path], list]:
    return lambda entries, marker: [*entries, (name, payload(marker))]


_CONSTANTS = PROGRAM_PREFIX + "data/constants/model_constants_config.json"
_CUSTOM = json.dumps({"config": {"c": {"path_name": "custom_obj_0", "is_param": False, "use_pickle": True,
                                       "tensor_meta": None}}}).encode()
_SAMPLE = PROGRAM_PREFIX + "data/sample_inputs/model.pt"
_WEIGHT_0 = "unexpected archive entry 'train/data/weights/weight_0'"


def _custom_object(entries: list, marker: Path) -> list:
    return [*replace_entry(entries, _CONSTANTS, _CUSTOM), (PROGRAM_PREFIX + "data/constants/custom_obj_0",
                                                           payload(marker))]


for _id, _command, _problem, _setup in (
        ("pickled-weight-train", "train", _WEIGHT_0, _program(_pickled_weight)),  # also as a real process
        ("pickled-weight-in-process", "train", _WEIGHT_0, _program(_pickled_weight)),
        ("pickled-weight-infer", "infer", _WEIGHT_0, _program(_pickled_weight)),
        ("sample-inputs-pickle", "train", f"archive entry '{_SAMPLE}' must be empty",
         _program(lambda e, m: replace_entry(e, _SAMPLE, payload(m)))),
        ("custom-object", "train", "archive entry 'train/data/constants/custom_obj_0'", _program(_custom_object)),
        ("odd-name", "train", "archive entry 'train/evil.pkl'", _program(_added("train/evil.pkl"))),
        ("config-not-empty", "train", f"archive entry '{CONFIG}' must be the empty config",
         _program(lambda e, m: replace_entry(e, CONFIG, pickled_weight_config()))),
        ("zip-slip", "train", "archive entry '../../outside/evil' is not a plain path",
         _program(_added("../../outside/evil"))),
        ("zip-slip-allowed-tail", "train", "archive entry '../models/model.json' is not a plain path",
         _program(_added("../models/model.json"))),
        ("second-prefix", "infer", "'evil/data/sample_inputs/model.pt' lies outside the archive's directory",
         _program(lambda e, m: [*e, ("evil/data/sample_inputs/model.pt", b"")])),
        ("absolute-entry", "train", "archive entry '/tmp/evil' is not a plain path", _program(_added("/tmp/evil"))),
        ("backslash-entry", "train", "is not a plain path", _program(_added("train\\..\\..\\evil"))),
        ("duplicate-entry", "train", f"archive entry '{CONFIG}' appears twice",
         _program(lambda e, m: [*e, (CONFIG, pickled_weight_config())])),
        ("bomb-ratio", "train", f"archive entry '{MODEL_JSON}' | zip bomb", _program(
            lambda e, m: replace_entry(e, MODEL_JSON, deflated_blob(64 << 20)), compress={MODEL_JSON: 8})),
        ("bomb-declared", "infer", f"archive entry '{MODEL_JSON}' declares 4294967295 bytes",
         _program(lambda e, m: e, compress={MODEL_JSON: 8}, declared=(MODEL_JSON, 0xFFFFFFFF)))):
    row(f"program-{_id}", _command, f"train.pt2: | {_problem}", _setup)
REAL_PROCESS.add("program-pickled-weight-train")


# ---- 6: safetensors files of the bundle ------------------------------------------------------------------
def _safetensors(name: str, attack: str) -> Setup:
    def setup(root: Path) -> None:
        tamper_safetensors(root / "bundle" / name, attack)
        resign(root / "bundle", name)
    return setup


def _swapped(name: str) -> Setup:
    return lambda root: tamper_safetensors(root / "bundle" / name, "huge-header-length")  # the manifest left as it was


def _personalised(attack: str) -> Setup:
    def setup(root: Path) -> None:
        from edge_client.bundle import read_bundle
        from edge_client.lora_store import apply_update
        from edge_client.update import write_update

        bundle = read_bundle(root / "bundle")
        tensors = {k: v + np.float32(0.01) for k, v in bundle.lora().items()}
        update = write_update(root / "u.safetensors", tensors, bundle=bundle, num_examples=2, mean_loss=1.0)
        apply_update(bundle, update)
        lora = root / "bundle" / "personalised" / "lora-0001.safetensors"
        tamper_safetensors(lora, attack)
        resign_personalised(root / "bundle")
    return setup


def _reason(file: str, attack: str) -> str:
    return f"{file}: not a safetensors file ({SAFETENSORS_ATTACKS[attack][1]}"


for _attack in SAFETENSORS_ATTACKS:
    row(f"lora-{_attack}-infer", "infer", _reason("lora.safetensors", _attack),
        _safetensors("lora.safetensors", _attack))
for _file, _attack, _command in (
        ("weights.safetensors", "huge-header-length", "infer"), ("weights.safetensors", "terabyte-shape", "train"),
        ("weights.safetensors", "unexpected-dtype", "info"), ("weights.safetensors", "overlapping-offsets", "join"),
        ("text_features.safetensors", "header-not-json", "infer"),
        ("text_features.safetensors", "deeply-nested-json", "train"),
        ("lora.safetensors", "header-length-past-end", "train")):
    row(f"{_file.split('.')[0]}-{_attack}-{_command}", _command, _reason(_file, _attack), _safetensors(_file, _attack))
for _file, _command in (("weights.safetensors", "train"), ("lora.safetensors", "infer"),
                        ("text_features.safetensors", "info")):
    row(f"{_file.split('.')[0]}-swapped-{_command}", _command, f"{_file}: | sha256 does not match", _swapped(_file))
for _attack, _command in (("huge-header-length", "infer"), ("terabyte-shape", "train"), ("unexpected-dtype", "infer"),
                          ("deeply-nested-json", "info")):
    row(f"personalised-{_attack}-{_command}", _command, _reason("lora-0001.safetensors", _attack),
        _personalised(_attack))


# ---- the table -----------------------------------------------------------------------------------------
def _outside(root: Path, source: Path) -> None:
    """What the attacker aims at: copies of bundle files (so hashes match) and a victim directory."""
    outside = root / "outside"
    outside.mkdir()
    for name in ("model.onnx", "weights.safetensors", "train.pt2", "lora.safetensors"):
        shutil.copyfile(source / name, outside / name)
    shutil.copyfile(source / "weights.safetensors", outside / "secret.bin")
    (outside / "victim").mkdir()
    (outside / "victim" / "lora-0001.safetensors").write_bytes(b"someone else's file")
    (outside / "victim" / "notes.txt").write_text("keep me\n")


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=[pytest.mark.processes] if r.id in REAL_PROCESS else [])
                                 for r in ROWS])
def test_bundle_attack(row: Hostile, pristine_bundle: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("FEDMVP_BUNDLE", raising=False)
    shutil.copytree(pristine_bundle, tmp_path / "bundle")
    class_image(0, np.random.default_rng(3)).save(tmp_path / "img.jpg")
    write_local_data(tmp_path / "local", ["red_circle", "blue_square"], per_class=2)
    _outside(tmp_path, pristine_bundle)
    SETUPS[row.id](tmp_path)
    before = {p: tree_digest(tmp_path / p) for p in row.unchanged}
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = run("edge-client", row.args, tmp_path, env=env, in_process=row.id not in REAL_PROCESS)
    parts = row.fragment.split(" | ")  # the file and the problem, on the same line
    assert_one_line_error(done, row.exit_code, parts[0])
    assert [line for line in (done.stdout + done.stderr).splitlines() if all(p in line for p in parts)], \
        f"no line holds {parts}:\n{(done.stdout + done.stderr)[-3000:]}"
    assert not (tmp_path / "outside" / "marker").exists(), "the pickle's payload ran"
    assert not (tmp_path / "updates").exists()
    for path in row.unchanged:
        assert tree_digest(tmp_path / path) == before[path], f"{path} changed"
