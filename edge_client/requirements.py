"""Whether this device can run each file of a bundle, from the manifest's ``requires`` and what is installed.

Why: a file a device's runtime cannot read fails deep inside torch or ONNX Runtime (a JetPack torch older
than the exporter's refuses train.pt2 with a schema error; docs/howto/jetson.md). The exporter records what
each file needs (``fedmvp_formats/artifact_requirements.py``); here it is compared with the installed
versions (package metadata: nothing is imported, so the inference path stays torch-free) before anything
loads. ``artifact_blockers`` is the check for a caller about to load a file (training, a fallback between
training programs); ``runtime_blocker`` is what ``runtime_choice`` asks per runtime (named: refused in one
line; auto: skipped, and the choice says so). A bundle exported before the section existed is not checked.
"""

from __future__ import annotations

from typing import Any

from fedmvp_formats.artifact_requirements import REQUIRES, describe_need, installed_version, satisfies

from edge_client.bundle import Bundle

# The role whose file each registered runtime reads (a runtime registered later may say its own: ``role``).
RUNTIME_ROLES = {"ort": "onnx", "openvino": "onnx", "torchscript": "torchscript", "executorch": "executorch"}


def recorded(bundle: Bundle) -> dict[str, Any] | None:
    """The bundle's ``requires`` section, or None when it was exported before one was recorded."""
    return bundle.manifest.get(REQUIRES)


def unmet(file: str, package: str, need: dict[str, Any]) -> str | None:
    """One line saying why this device's ``package`` cannot read ``file``, or None when it can."""
    have = installed_version(package)
    if have is not None and satisfies(have, need):
        return None
    found = f"this device has {have}" if have is not None else f"{package} is not installed on this device"
    return f"{file} needs {describe_need(package, need)}; {found}"


def role_status(entry: dict[str, Any]) -> dict[str, Any]:
    """One role of ``requires``: per package what is installed and whether it fits; the file runs where any
    package fits (``needs`` lists alternatives)."""
    packages = {}
    for package, need in entry["needs"].items():
        why = unmet(entry["file"], package, need)
        packages[package] = {"needs": describe_need(package, need), "installed": installed_version(package),
                             "ok": why is None, **({"why": why} if why else {})}
    runs = any(p["ok"] for p in packages.values())
    return {"file": entry["file"], "runs": runs, "packages": packages,
            **({} if runs else {"why": "; ".join(p["why"] for p in packages.values())})}


def artifact_report(bundle: Bundle) -> dict[str, Any]:
    """What `edge-client info` shows: ``{"recorded": False}`` for a bundle without the section, else per role
    whether its file runs here and why not."""
    section = recorded(bundle)
    if section is None:
        return {"recorded": False}
    return {"recorded": True, "roles": {role: role_status(entry) for role, entry in sorted(section.items())}}


def artifact_blockers(bundle: Bundle) -> dict[str, str]:
    """{role: the one line why this device cannot run its file} for every role it cannot; {} where all run
    or nothing was recorded. A pure check: a caller decides what to do (refuse, fall back)."""
    section = recorded(bundle) or {}
    out = {}
    for role, entry in section.items():
        status = role_status(entry)
        if not status["runs"]:
            out[role] = status["why"]
    return out


def runtime_blocker(bundle: Bundle, runtime: str, factory: Any) -> str | None:
    """Why the runtime ``runtime`` (its factory, whose ``version_key`` names its package) cannot read its file
    of ``bundle`` here, or None: it can, or nothing was recorded for that file or package."""
    role = getattr(factory, "role", None) or RUNTIME_ROLES.get(runtime)
    entry = (recorded(bundle) or {}).get(role) if role else None
    package = getattr(factory, "version_key", None)
    if entry is None or package not in entry["needs"]:
        return None
    return unmet(entry["file"], package, entry["needs"][package])


def bundle_requirements(bundle: Any) -> dict[str, Any]:
    """``artifact_report`` of the bundle at ``bundle`` (a directory, or None: the default), read without
    hashing its files (`info` verifies them apart); ``{"error": line}`` where its manifest cannot be read."""
    from edge_client.bundle import BundleError, read_bundle

    try:
        return artifact_report(read_bundle(Bundle.resolve_dir(bundle), verify=False))
    except BundleError as err:
        return {"error": " ".join(str(err).split())}
