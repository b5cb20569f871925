"""Which runtime and precision a bundle runs with here: named, or ``auto`` (the fastest verified one).

Why: reduced precision is where the speed left on a CPU is (OpenVINO bf16 is ~2x ONNX Runtime fp32 on
ViT-B-16, docs/benchmarks.md, edge runtimes), but it must not change the answers. ``auto`` therefore runs every
candidate (``edge_client/engines.py``) on the bundle's check images, holds its logits to the parity
rules the exporter uses (``fedmvp_formats/parity_rules.py``: top-1 agreement, and a logit bound)
against the bundle as exported on ONNX Runtime's CPU provider, times the ones that pass at batch 8,
and takes the fastest. A candidate that fails is named in the one line that says what was picked; when
none passes, the bundle as exported on ONNX Runtime runs (its parity was checked at export).

The check images are the bundle's own (``Bundle.check_images``, ``edge_client/check_images.py``): the
pictures the exporter shipped (its parity images: ``--images`` or the run's test images, or generated
colour fields), or, in a bundle exported before they travelled, colour fields drawn from its id (so
every device of a bundle checks the same ones), normalised as `infer` normalises a file. Their reference
logits and every verdict are cached per bundle id and machine (CPU, its flags, runtime versions,
threads, provider) in ``$FEDMVP_CACHE/edge-runtime/`` (one JSON file, written atomically): a second call
reads the verdict and verifies nothing. The bundle id is the manifest's sha256, which hashes the check
file, so other check images are another bundle and another verdict; the record also names them
(``check``: source, sha256 or seed). docs/architecture.md, "Runtimes".
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedmvp_formats.atomic import write_json
from fedmvp_formats.bundle_manifest import CHECK_SECTION
from fedmvp_formats.files import cache_root
from fedmvp_formats.parity_rules import agreement

from edge_client.bundle import Bundle
from edge_client.check_images import CHECK_COUNT, check_words, id_seed
from edge_client.engines import (DEFAULT_RUNTIME, Candidate, Engine, candidates, factory, open_engine, runtime_names,
                                 unavailable)
from edge_client.requirements import runtime_blocker
from edge_client.runtime import ProviderError, _one_line, default_threads

CACHE_FORMAT = "fedmvp-runtime-verdicts"
CACHE_VERSION = 3  # 2: verdicts judge reduced precisions on images not near-tied; 3: on at least MIN_DECISIVE
# of them (parity_rules): a verdict cached by an older rule is judged again
CACHE_FOLDER = "edge-runtime"
CHECK_BATCH = 8  # `edge-client infer`'s default batch: the one timed


@dataclass
class Choice:
    """What runs, how it was decided (named, only, auto, fallback), and the line that says so."""

    candidate: Candidate
    how: str
    line: str
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    cache: Path | None = None
    cached: bool = False
    engine: Engine | None = None  # the chosen candidate's engine, when this call built it
    skipped: dict[str, str] = field(default_factory=dict)  # auto: runtimes too old for the bundle, and why

    def to_json(self) -> dict[str, Any]:
        return {"runtime": self.candidate.runtime, "precision": self.candidate.precision, "how": self.how,
                "line": self.line, "cache": None if self.cache is None else str(self.cache),
                "cached": self.cached, "verdicts": self.verdicts, "skipped": self.skipped}


def choose(bundle: Bundle, runtime: str = DEFAULT_RUNTIME, precision: str = "auto", provider: str = "auto",
           threads: int | None = None) -> Choice:
    """The candidate to run; ``auto`` in either argument verifies and times what it leaves open. A runtime
    whose package this device has outside the bundle's recorded range (``edge_client/requirements.py``) is
    refused when named and, under auto, skipped: the choice's line and record say so."""
    found, notes = candidates(bundle, runtime, precision)
    skipped = too_old(bundle) if runtime == "auto" else {}
    if len(found) == 1:
        only = found[0]
        how = "named" if runtime != "auto" and precision != "auto" else "only"
        if how == "named":
            reason = ""
        elif runtime != "auto":  # the runtime was named; of its precisions, one is offered
            reason = " (named; its only precision offered here)"
        else:
            reason = f" (the only one offered here{': ' + '; '.join(notes) if notes else ''})"
        return Choice(only, how, f"runtime: {only.describe()}{reason}", skipped=skipped)
    if DEFAULT_RUNTIME in skipped:  # auto's reference is the bundle as exported on ONNX Runtime
        raise ProviderError(f"auto verifies against ONNX Runtime, which cannot run this bundle here "
                            f"({skipped[DEFAULT_RUNTIME]}); name a runtime with --runtime")
    choice = _auto(bundle, found, provider, threads)
    if skipped:
        choice.skipped = skipped
        choice.line += "".join(f"; {name} skipped, cannot run here: {why}" for name, why in skipped.items())
    return choice


def too_old(bundle: Bundle) -> dict[str, str]:
    """{runtime: why} for the installed runtimes the bundle's recorded requirements rule out here."""
    return {name: why for name in runtime_names() if unavailable(name) is None
            and (why := runtime_blocker(bundle, name, factory(name))) is not None}


def _auto(bundle: Bundle, found: list[Candidate], provider: str, threads: int | None) -> Choice:
    path = cache_path(bundle, provider, threads)
    check = check_note(bundle)
    record = _read_cache(path, bundle, check)
    verdicts: dict[str, dict[str, Any]] = record.get("verdicts", {})
    missing = [c for c in found if c.key not in verdicts]
    built: dict[str, Engine] = {}
    if missing:
        pixels = check_images(bundle)
        reference = record.get("reference")
        cpu = None  # the reference's engine: also ONNX Runtime's candidate where that runs on the CPU
        if reference is None:
            cpu = open_engine(bundle, Candidate(DEFAULT_RUNTIME, bundle.precision), "cpu", threads)
            reference = _logits(cpu, bundle, pixels)[0].tolist()
        for candidate in missing:
            reuse = cpu if candidate.runtime == DEFAULT_RUNTIME and cpu is not None \
                and _first_provider(provider) == "CPUExecutionProvider" else None
            verdicts[candidate.key], engine = _verify(bundle, candidate, provider, threads, pixels,
                                                      np.asarray(reference, dtype=np.float64), reuse)
            if engine is not None:
                built[candidate.key] = engine
        record = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "bundle_id": bundle.id,
                  "machine": machine_record(provider, threads), "check": check, "reference": reference,
                  "verdicts": verdicts}
        path = _write_cache(path, record)
    return _pick(bundle, found, verdicts, path, cached=not missing, built=built,
                 source=check_words(check.get("source")))


def _pick(bundle: Bundle, found: list[Candidate], verdicts: dict[str, dict[str, Any]], path: Path | None,
          cached: bool, built: dict[str, Engine], source: str) -> Choice:
    """The fastest candidate that passed; the faster ones that failed are named in the line."""
    ranked = sorted(found, key=lambda c: (not verdicts[c.key]["passed"], verdicts[c.key].get("ms_per_image")
                                          or float("inf")))
    passed = [c for c in ranked if verdicts[c.key]["passed"]]
    where = f"; cache {path}" if path is not None else ""
    shown = {c.key: verdicts[c.key] for c in found}
    if not passed:
        fallback = Candidate(DEFAULT_RUNTIME, bundle.precision)
        if fallback not in found:
            raise ProviderError(f"no candidate passed verification on {bundle.path}'s check images: "
                                + "; ".join(f"{c.describe()}: {_why(verdicts[c.key])}" for c in found))
        line = (f"runtime: {fallback.describe()}, the bundle as exported: auto verified no candidate on the "
                f"bundle's check images ({'; '.join(f'{c.describe()}: {_why(verdicts[c.key])}' for c in found)})"
                + where)
        return Choice(fallback, "fallback", line, shown, path, cached, built.get(fallback.key))
    best = passed[0]
    v = verdicts[best.key]
    failed = [c for c in found if not verdicts[c.key]["passed"]]
    others = ", ".join(f"{c.describe()} {verdicts[c.key]['ms_per_image']:.1f}" for c in passed[1:])
    line = (f"runtime: {best.describe()}, picked by auto: {v['ms_per_image']:.1f} ms/image at batch {CHECK_BATCH}"
            + (f" (vs {others})" if others else "")
            + f"; verified on {v['images']} check images ({source}): top-1 {100 * v['top1_agreement']:.2f}%"
            + (f" ({100 * v['decisive_agreement']:.2f}% of the {v['decisive_images']} not near-tied)"
               if v.get("decisive_images", v["images"]) != v["images"] else "")
            + f", max |logit diff| {v['max_abs_logit_diff']:.2e}"
            + "".join(f"; {c.describe()} failed verification, not used: {_why(verdicts[c.key])}" for c in failed)
            + ("; cached verdict" if cached else "") + where)
    return Choice(best, "auto", line, shown, path, cached, built.get(best.key))


def _why(verdict: dict[str, Any]) -> str:
    return verdict.get("error") or verdict.get("describe") or "failed"


def _first_provider(provider: str) -> str:
    """The ONNX Runtime provider ``provider`` puts first here (auto: TensorRT, CUDA, then CPU)."""
    from edge_client.runtime import AUTO_ORDER, PROVIDER_NAMES, available_providers

    if provider != "auto":
        return PROVIDER_NAMES.get(provider, provider)
    available = available_providers()
    return next((p for p in AUTO_ORDER if p in available), "CPUExecutionProvider")


def _verify(bundle: Bundle, candidate: Candidate, provider: str, threads: int | None, pixels: np.ndarray,
            reference: np.ndarray, engine: Engine | None = None) -> tuple[dict[str, Any], Engine | None]:
    """Run ``candidate`` (on ``engine`` where one is open already) on the check images: the parity rules'
    verdict and ms per image at CHECK_BATCH."""
    try:
        engine = engine or open_engine(bundle, candidate, provider, threads)
        logits, batch_ms = _logits(engine, bundle, pixels)
    except Exception as err:  # noqa: BLE001 - a runtime that cannot build or run it is a failed candidate
        return {"passed": False, "error": f"cannot run it: {_one_line(err)}"}, None
    found = agreement(reference, logits, candidate.precision, bound_reduced=True)
    verdict = {"passed": found.passed, "images": found.images, "top1_agreement": round(found.top1_agreement, 6),
               "decisive_images": found.decisive_images, "decisive_agreement": round(found.decisive_agreement, 6),
               "max_abs_logit_diff": float(f"{found.max_abs_logit_diff:.3e}"),
               "max_allowed_diff": found.max_allowed_diff, "device": engine.device,
               "ms_per_image": round(statistics.median(batch_ms) / CHECK_BATCH, 4), "describe": found.describe()}
    return verdict, engine


def _logits(engine: Engine, bundle: Bundle, pixels: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Logits of ``pixels`` at CHECK_BATCH (one warm-up batch first) and each batch's milliseconds."""
    name = bundle.manifest.get("onnx", {}).get("input", next(iter(engine.inputs)))
    dtype = engine.inputs.get(name, np.float32)
    batches = [np.ascontiguousarray(pixels[i:i + CHECK_BATCH], dtype=dtype)
               for i in range(0, len(pixels), CHECK_BATCH)]
    index = engine.outputs.index("logits")
    engine.run({name: batches[0]})
    parts, times = [], []
    for batch in batches:
        start = time.perf_counter()
        parts.append(engine.run({name: batch})[index])
        times.append((time.perf_counter() - start) * 1000.0)
    return np.concatenate(parts).astype(np.float64), times


def check_images(bundle: Bundle, count: int | None = None) -> np.ndarray:
    """The bundle's check images [N, 3, S, S] (``Bundle.check_images``), the first ``count`` where given."""
    pixels = bundle.check_images().pixels
    return pixels if count is None else pixels[:count]


def check_note(bundle: Bundle) -> dict[str, Any]:
    """Which check images a verdict was reached on, from the manifest alone: the shipped file's source, count
    and sha256, or (a bundle without them) the id seed its colour fields are drawn from."""
    section = bundle.manifest.get(CHECK_SECTION)
    if section is None:
        return {"images": CHECK_COUNT, "batch": CHECK_BATCH, "seed": id_seed(bundle.id)}
    return {"images": section["images"], "batch": CHECK_BATCH, "source": section["source"],
            "sha256": bundle.manifest["files"][section["file"]]["sha256"]}


def machine_record(provider: str, threads: int | None) -> dict[str, Any]:
    """What a verdict holds for: the CPU and its flags, the runtimes' versions, threads and provider."""
    cpu, flags = _cpu()
    record: dict[str, Any] = {"machine": platform.machine(), "cpu": cpu,
                              "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
                              "threads": default_threads() if threads is None else threads, "provider": provider}
    for name in runtime_names():
        record[factory(name).version_key] = runtime_version(name)
    return record


def runtime_version(name: str) -> str | None:
    """The registered runtime ``name``'s version, or None where it cannot run here."""
    return None if unavailable(name) is not None else factory(name).version()


def _cpu() -> tuple[str, str]:
    """The CPU's model name and flags (Linux /proc/cpuinfo; elsewhere platform's processor string)."""
    model, flags, seen_model = platform.processor(), "", False
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not seen_model:
                model, seen_model = value.strip(), True
            elif key.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return model, flags


def cache_path(bundle: Bundle, provider: str, threads: int | None) -> Path:
    """``$FEDMVP_CACHE/edge-runtime/<bundle id>-<machine>.json``."""
    machine = json.dumps(machine_record(provider, threads), sort_keys=True).encode()
    return cache_root() / CACHE_FOLDER / f"{bundle.id[:20]}-{hashlib.sha256(machine).hexdigest()[:16]}.json"


def _read_cache(path: Path, bundle: Bundle, check: dict[str, Any]) -> dict[str, Any]:
    """The cached record, or {} when there is none or it is not one this fedmvp wrote for this bundle and
    these check images."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ok = isinstance(record, dict) and record.get("format") == CACHE_FORMAT \
        and record.get("version") == CACHE_VERSION and record.get("bundle_id") == bundle.id \
        and record.get("check") == check and isinstance(record.get("verdicts", {}), dict) \
        and _logit_table(record.get("reference"), bundle, check["images"])
    return record if ok else {}


def _logit_table(value: Any, bundle: Bundle, rows: int) -> bool:
    """Whether ``value`` is ``rows`` rows (one per check image) of one logit per class (or absent)."""
    if value is None:
        return True
    try:
        table = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return table.shape == (rows, len(bundle.class_names)) and bool(np.all(np.isfinite(table)))


def _write_cache(path: Path, record: dict[str, Any]) -> Path | None:
    """Write the record atomically; None when the cache folder cannot be written (the choice still stands)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, record)
    except OSError:
        return None
    return path
