"""What `edge-client info` reports: the bundle, and what this device can run it with."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from fedmvp_formats.bundle_manifest import PREVIOUS

from edge_client.bundle import Bundle, BundleError, read_bundle
from edge_client.engines import DEFAULT_RUNTIME


def memory_available_bytes() -> int | None:
    """Available system memory (Linux MemAvailable; else free physical pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def torch_report() -> dict[str, Any]:
    """torch's presence, version and CUDA devices with free memory (imports torch only if installed)."""
    try:
        if importlib.util.find_spec("torch") is None:
            return {"installed": False}
    except (ImportError, ValueError):
        return {"installed": False}
    try:
        import torch
    except Exception as err:  # noqa: BLE001 - a broken install is worth reporting, not crashing on
        return {"installed": False, "error": " ".join(str(err).split())[:200]}
    out: dict[str, Any] = {"installed": True, "version": torch.__version__,
                           "cuda_available": bool(torch.cuda.is_available()), "gpus": []}
    if out["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            try:
                free, total = torch.cuda.mem_get_info(index)
            except RuntimeError:
                free, total = 0, 0
            out["gpus"].append({"index": index, "name": torch.cuda.get_device_name(index),
                                "free_gb": free / 2**30, "total_gb": total / 2**30,
                                "bf16": bool(torch.cuda.is_bf16_supported())})
    return out


def bundle_report(bundle: str | os.PathLike | None) -> dict[str, Any]:
    """What `info` says about the bundle; a bundle that fails verification is still described."""
    from edge_client.lora_store import active_lora

    path = Bundle.resolve_dir(bundle)
    out: dict[str, Any] = {"path": str(path), "hashes_ok": False}
    try:
        verified = Bundle.open(bundle, verify=True)
        out["hashes_ok"] = True
    except BundleError as err:
        out["error"] = str(err)
        try:
            verified = read_bundle(path, verify=False)  # still describe what is there
        except BundleError:
            return out
    m = verified.manifest
    source = m.get("source") or {}
    out.update({"manifest": True, "bundle_id": verified.id, "round": verified.round,
                "run": source.get("run"), "precision": m.get("precision"),
                "model": (m.get("model") or {}).get("clip"), "classes": verified.class_names,
                "trainable": verified.trainable, "promptformer_digest": verified.promptformer_digest,
                "refreshable": verified.refreshable, "previous": (verified.path / PREVIOUS).is_dir(),
                # where `auto`'s check images came from (run-test: the run's test images travelled here)
                "check_images": (m.get("check_images") or {}).get("source", "bundle-id"),
                "files": {name: entry.get("sha256") for name, entry in sorted(m.get("files", {}).items())},
                "bytes": sum(int(e.get("bytes", 0)) for e in m.get("files", {}).values())})
    if out["hashes_ok"]:
        out["classes_pinned"] = _classes_pinned(verified)
        try:
            active = active_lora(verified)
            out["lora"] = {**active.to_json(), "describe": active.describe()}
        except BundleError as err:
            out["hashes_ok"] = False
            out["error"] = str(err)
    return out


def _classes_pinned(bundle: Bundle) -> bool:
    """Whether model.onnx pins the manifest's class list (read_bundle refused a mismatch already;
    False: exported before the pin, the class names are taken on trust)."""
    from edge_client.bundle import onnx_classes_pin

    try:
        return onnx_classes_pin(bundle.file("onnx")) is not None
    except BundleError:
        return False


def runtimes_report() -> dict[str, Any]:
    """Each registered runtime: available or why not, its version (edge_client/engines.py)."""
    from edge_client.engines import runtime_names, unavailable
    from edge_client.runtime_choice import runtime_version

    out: dict[str, Any] = {}
    for name in runtime_names():
        why = unavailable(name)
        out[name] = {"available": why is None, **({"why": why} if why else {"version": runtime_version(name)})}
    return out


def runtime_report(bundle: str | os.PathLike | None, runtime: str, precision: str, provider: str,
                   threads: int | None) -> dict[str, Any]:
    """What would run the bundle here (``runtime_choice.choose``), or the one line why nothing can."""
    from edge_client.engines import offered, runtime_names, unavailable
    from edge_client.runtime import ProviderError
    from edge_client.runtime_choice import choose

    try:
        verified = Bundle.open(bundle, verify=True)
        choice = choose(verified, runtime, precision, provider, threads)
    except (BundleError, ProviderError) as err:
        return {"error": " ".join(str(err).split())}
    offers = {name: offered(name, verified) for name in runtime_names() if unavailable(name) is None}
    return {**choice.to_json(), "offered": offers}


def describe(bundle: str | os.PathLike | None = None, runtime: str = DEFAULT_RUNTIME, precision: str = "auto",
             provider: str = "auto", threads: int | None = None) -> dict[str, Any]:
    """{"bundle": ..., "device": ..., "runtime": ...} for `edge-client info`."""
    from edge_client.runtime import available_providers, default_threads

    try:
        providers = available_providers()
    except ImportError:
        providers = []
    memory = memory_available_bytes()
    report = bundle_report(bundle)
    return {"bundle": report,
            "device": {"providers": providers, "runtimes": runtimes_report(), "torch": torch_report(),
                       "cpus": default_threads(), "memory_available_gb": None if memory is None else memory / 2**30,
                       "cwd": str(Path.cwd())},
            "runtime": runtime_report(bundle, runtime, precision, provider, threads) if report["hashes_ok"]
            else {"error": "the bundle failed verification"}}
