"""The fleet benchmark's cost model and plot (docs/benchmarks.md, "Fleets"): fitted to the measured
rows, extrapolated to fleets this machine cannot hold; every row says which it is (``measured``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

EXTRAPOLATE_TO = (1000, 10000)


def line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of y against x by least squares, the slope at least 0 (a cost that falls with the
    fleet is noise on a shared machine); one point: through the origin (cost proportional to N)."""
    if len(set(x.tolist())) < 2:
        return 0.0, float(y.mean() / x.mean()) if x.mean() else 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:
        return float(y.mean()), 0.0
    return float(intercept), float(slope)


def fit(rows: list[dict]) -> dict:
    """Least-squares fits over the measured replay rows:

    - ``cpu_per_minute``: SuperLink CPU-s per minute = a + k * N (k: one device's polling, heartbeats and
      updates at the measured rate together);
    - ``cpu_per_minute_split``: a + b * N + c * updates per minute, where the rows let polling and
      updates be told apart (the update rate not proportional to N), else None;
    - ``rss``: SuperLink resident MB = m0 + m1 * N;
    - ``updates_per_minute_per_device``: the median measured rate (what the extrapolation assumes)."""
    n = np.array([r["devices"] for r in rows], dtype=float)
    per_minute = np.array([r["superlink_cpu_s_per_min"] for r in rows], dtype=float)
    updates = np.array([r["updates_per_min"] for r in rows], dtype=float)
    rss = np.array([r["superlink_rss_mb"] for r in rows], dtype=float)
    a, k = line(n, per_minute)
    m0, m1 = line(n, rss) if len(rows) > 1 else (float(rss.mean()), 0.0)
    model: dict = {"points": len(rows), "devices": [int(x) for x in n],
                   "cpu_per_minute": {"a": a, "k_per_device": k}, "rss": {"m0_mb": m0, "m1_mb_per_device": m1},
                   "updates_per_minute_per_device": float(np.median(updates / n)), "cpu_per_minute_split": None}
    design = np.stack([np.ones_like(n), n, updates], axis=1)
    if len(rows) >= 4 and np.linalg.matrix_rank(design) == 3 and np.linalg.cond(design) < 1e6:
        coef = np.linalg.lstsq(design, per_minute, rcond=None)[0]
        model["cpu_per_minute_split"] = {"a": float(coef[0]), "b_per_device": float(coef[1]),
                                         "c_per_update": float(coef[2])}
    return model


def extrapolate(model: dict, devices: int) -> dict:
    """A row for ``devices`` from the fitted model, each device updating at the measured rate;
    ``superlink_cores``: the SuperLink's CPU-s per second (over 1: more than one core)."""
    cpu = model["cpu_per_minute"]["a"] + model["cpu_per_minute"]["k_per_device"] * devices
    rate = model["updates_per_minute_per_device"] * devices
    return {"run": f"extrapolated N={devices}", "kind": "model", "devices": devices, "measured": False,
            "updates_per_min": rate, "superlink_cpu_s_per_min": cpu,
            "superlink_cpu_s_per_update": cpu / rate if rate else None, "superlink_cores": cpu / 60.0,
            "superlink_rss_mb": model["rss"]["m0_mb"] + model["rss"]["m1_mb_per_device"] * devices}


def plot(section: dict, path: Path) -> Path | None:
    """fleet.png: SuperLink CPU-s per update and resident MB against N, measured points and the fitted lines
    extended to the extrapolated sizes (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import _save

    model = section.get("config", {}).get("model")
    measured = [r for r in section.get("rows", []) if r.get("measured") and r.get("kind") == "replay"
                and not r.get("vanished_devices")]
    if not model or not measured:
        return None
    fig, (cpu, mem) = plt.subplots(1, 2, figsize=(10, 4))
    xs = np.geomspace(max(1, min(r["devices"] for r in measured)), max(EXTRAPOLATE_TO), 50)
    fitted = [extrapolate(model, int(x)) for x in xs]
    for ax, key, label in ((cpu, "superlink_cpu_s_per_update", "SuperLink CPU-s per accepted update"),
                           (mem, "superlink_rss_mb", "SuperLink resident MB")):
        ax.plot([r["devices"] for r in measured], [r[key] for r in measured], "o", label="measured")
        ax.plot(xs, [f[key] for f in fitted], "--", label="fitted, extrapolated")
        for r in section["rows"]:
            if not r.get("measured"):
                ax.plot(r["devices"], r[key], "x", color="red")
        ax.set_xscale("log")
        ax.set_xlabel("devices (N)")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("fedmvp serve --mode buffered: server cost against fleet size")
    return _save(fig, path)
