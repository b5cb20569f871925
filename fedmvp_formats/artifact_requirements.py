"""What a device needs to run each file of a bundle: the manifest's ``requires`` section, one definition.

Why: a bundle's files are read by runtimes whose versions differ per device (a Jetson's JetPack torch is
older than the exporter's; docs/howto/jetson.md). The exporter records, per role, the packages that read the
role's file and the versions that do (``requirements_section``); `edge-client` compares them with what is
installed before it loads anything (``edge_client/requirements.py``), so a device that cannot read a file
says so in one line instead of failing inside torch or ONNX Runtime. ``check_requires`` holds a manifest's
section to its shape (``bundle_manifest.check_manifest`` calls it). Standard library only: the device's
inference path reads this without torch.

The section: ``{role: {"file": name, "needs": {package: {"min": version, "below": version (optional),
"why": text}}}}``. ``needs`` lists alternatives, one per package that can read the file (model.onnx: ONNX
Runtime or OpenVINO); a file runs where one of them is installed at a version in ``[min, below)``.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Mapping
from typing import Any

REQUIRES = "requires"

# The first ONNX Runtime release implementing each ONNX opset (a model stamped with opset N needs it):
# ONNX Runtime's compatibility page, "ONNX opset support" (onnxruntime.ai/docs/reference/compatibility.html).
ORT_BY_OPSET: dict[int, str] = {13: "1.6", 14: "1.8", 15: "1.9", 16: "1.12", 17: "1.12", 18: "1.14", 19: "1.15",
                                20: "1.17", 21: "1.18"}
# OpenVINO: the oldest release this project supports (pyproject's ``openvino`` extra), whose ONNX frontend
# reads these opsets; an opset without a row is not recorded for OpenVINO (add the row when one is known).
OPENVINO_BY_OPSET: dict[int, str] = {opset: "2024.0" for opset in range(13, 19)}

# Measured (docs/howto/jetson.md, "Which torch reads which file"): a tiny bundle exported with torch 2.14.1
# (--format torchscript), its files loaded and run in clean venvs of PyPI torch 2.4, 2.6, 2.8, 2.9, 2.10,
# 2.12 and 2.13 (torch.jit.load + forward; torch.export.load(...).module() + forward and a LoRA backward):
# the same logits in each that loads. Keyed by the exporter's torch major.minor: the oldest torch that read
# its archive (TorchScript: 2.4, the oldest tried and this project's torch floor; train.pt2: 2.9, as 2.8
# and older refuse it with "There is no item named 'version' in the archive"). An exporter torch without a
# row records its own major.minor.
TORCHSCRIPT_MIN_BY_EXPORTER: dict[str, str] = {"2.14": "2.4"}
TRAIN_PT2_MIN_BY_EXPORTER: dict[str, str] = {"2.14": "2.9"}

# How each role's requirement is computed ("presets are data": a role added later is one row). Per package:
# ``opset``: the minimum by the manifest's onnx.opset from that table; ``exporter``: by the exporter's
# installed major.minor of the package, from that table of measured minimums (no row: the exporter's own
# major.minor); ``below``: an exclusive upper bound, where one is known; ``why``: what the line says.
_TORCH = "torch {exporter} wrote it; measured to load from torch {min}"
RULES: dict[str, dict[str, dict[str, Any]]] = {
    "onnx": {"onnxruntime": {"opset": ORT_BY_OPSET}, "openvino": {"opset": OPENVINO_BY_OPSET}},
    "training": {"torch": {"exporter": TRAIN_PT2_MIN_BY_EXPORTER, "why": "torch.export archive: " + _TORCH}},
    "torchscript": {"torch": {"exporter": TORCHSCRIPT_MIN_BY_EXPORTER, "why": "TorchScript archive: " + _TORCH}},
    "torchscript_training": {"torch": {"exporter": TORCHSCRIPT_MIN_BY_EXPORTER,
                                       "why": "TorchScript archive: " + _TORCH}},
    "executorch": {"executorch": {"exporter": {}, "why": "ExecuTorch program written by executorch {exporter}"}},
}

# The distributions that install each package (ONNX Runtime ships under several names).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml",
                    "onnxruntime-qnn", "onnxruntime-training"),
}

_VERSION = re.compile(r"^[0-9]{1,6}(\.[0-9]{1,6}){0,3}$")
_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
MAX_WHY = 200


def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (its distribution metadata; nothing is imported), or None."""
    for name in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_key(version: str) -> tuple[int, ...]:
    """The release numbers of a version string ("2.14.1+cpu" -> (2, 14, 1); "1.18.0rc1" -> (1, 18, 0))."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"[0-9]+", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(numbers)


def _pad(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def satisfies(version: str, need: Mapping[str, Any]) -> bool:
    """Whether ``version`` lies in ``[need["min"], need["below"])`` (no ``below``: no upper bound)."""
    have, low = _pad(version_key(version), version_key(need["min"]))
    if have < low:
        return False
    if need.get("below") is None:
        return True
    have, high = _pad(version_key(version), version_key(need["below"]))
    return have < high


def describe_need(package: str, need: Mapping[str, Any]) -> str:
    """``onnxruntime >= 1.14 (opset 18)``: what a line about a package names."""
    bound = f"{package} >= {need['min']}" + (f", < {need['below']}" if need.get("below") else "")
    return bound + (f" ({need['why']})" if need.get("why") else "")


def major_minor(version: str) -> str:
    """"2.14.1+cpu" -> "2.14"."""
    return ".".join(str(n) for n in version_key(version)[:2])


def requirements_section(manifest: Mapping[str, Any], exporter: Callable[[str], str | None] = installed_version
                         ) -> dict[str, Any]:
    """The ``requires`` section for the roles of ``manifest["files_by_role"]`` that RULES has a row for;
    ``exporter(package)``: the exporter's version of a package (default: the installed one). A role whose
    rule cannot be computed (an opset no table row covers for ONNX Runtime) is a ValueError naming the row."""
    section: dict[str, Any] = {}
    opset = (manifest.get("onnx") or {}).get("opset")
    for role, name in sorted(manifest["files_by_role"].items()):
        rules = RULES.get(role)
        if rules is None:
            continue
        needs: dict[str, Any] = {}
        for package, rule in rules.items():
            if "opset" in rule:
                minimum = rule["opset"].get(opset)
                if minimum is None:
                    if package == "onnxruntime":
                        raise ValueError(f"no minimum onnxruntime recorded for ONNX opset {opset!r}: add a row to "
                                         f"ORT_BY_OPSET in fedmvp_formats/artifact_requirements.py")
                    continue
                needs[package] = {"min": minimum, "why": f"opset {opset}"}
                continue
            made = exporter(package)
            if made is None:
                raise ValueError(f"{name} ({role}): {package} is not installed here, so its version cannot be "
                                 f"recorded")
            minimum = rule["exporter"].get(major_minor(made), major_minor(made))
            needs[package] = {"min": minimum, "why": rule["why"].format(exporter=made, min=minimum),
                              **({"below": rule["below"]} if rule.get("below") else {})}
        if needs:
            section[role] = {"file": name, "needs": needs}
    return section


def check_requires(section: Any, files_by_role: Mapping[str, Any], bad: Callable[[str, str], Exception]) -> None:
    """Hold a manifest's ``requires`` to its shape: a role of files_by_role, its file, and per package a
    version ``min`` (and ``below``) of release numbers and a short ``why``. ``bad(field, why)`` makes the
    one-line error."""
    if section is None:
        return
    if not isinstance(section, dict):
        raise bad(REQUIRES, f"must be a mapping, got {type(section).__name__}")
    for role, entry in section.items():
        field = f"{REQUIRES}.{role}"
        if not isinstance(role, str) or role not in files_by_role:
            raise bad(field, "names no role of files_by_role")
        if not isinstance(entry, dict) or entry.get("file") != files_by_role[role]:
            raise bad(f"{field}.file", f"is not files_by_role's {role} file ({files_by_role[role]!r})")
        needs = entry.get("needs")
        if not isinstance(needs, dict) or not needs:
            raise bad(f"{field}.needs", "must map one or more package names to {min, below, why}")
        for package, need in needs.items():
            where = f"{field}.needs[{package!r}]"
            if not isinstance(package, str) or not _PACKAGE.match(package):
                raise bad(where, "is not a package name (lower-case letters, digits, '_', '.', '-')")
            if not isinstance(need, dict) or not isinstance(need.get("min"), str) or not _VERSION.match(need["min"]):
                raise bad(f"{where}.min", "must be a version of release numbers (e.g. \"1.14\")")
            below = need.get("below")
            if below is not None and not (isinstance(below, str) and _VERSION.match(below)):
                raise bad(f"{where}.below", "must be a version of release numbers, or absent")
            why = need.get("why", "")
            if not isinstance(why, str) or len(why) > MAX_WHY or not why.isprintable():
                raise bad(f"{where}.why", f"must be printable text of at most {MAX_WHY} characters")
