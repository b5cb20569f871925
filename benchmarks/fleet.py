"""Fleets: N edge devices against one `fedmvp serve --mode buffered` (docs/benchmarks.md, "Fleets").

The server as deployed: `fedmvp certs --nodes N` (TLS, a key pair per device), `fedmvp serve --mode
buffered --node-keys` on 127.0.0.1, the demo preset with a [server] table (``server_table``: concurrency
every device, a version every N/5 updates, a short round_timeout). The devices are **replay devices**
(``benchmarks.fleet_device``): each a real Flower SuperNode of role edge with its own key, whose
messages a light ClientApp answers with the reply a real device sends (the round's real-sized LoRA
tensors plus a small delta, its identity, bundle id and train metrics) after 8-12 s of "training". The
server side, which is what this measures, cannot tell them from real devices: the same messages,
the same checks (fedmvp/federated/replies.py), accepted the same way. One run uses real `edge-client
join` devices (a bundle and images each; as many as memory holds, at most ``REAL_MAX``).

Per N, over a window once every device got work: SuperLink CPU-s per accepted update (and the whole
server side's: SuperLink, ServerApp, SuperExec, serve), SuperLink and server resident MB, resident MB
per device, accepted updates per minute, seconds from an update's reply to the checkpoint of the
version that used it, devices timed out or left out. The fleet sizes are stages of one deployment
(devices added between windows: the server starts, registers its node keys and runs its zero-shot
evaluation once). After the largest, 10% of its devices SIGKILL their SuperNode after receiving a
message (vanishing mid-update) and one more window is measured: no version may wait longer than the
preset's round_timeout. The largest N is chosen from the memory available at the start (half of
MemAvailable over ``REPLAY_MB``; ``MAX_DEVICES`` at most for the time budget) and said in ``config``.
A model is fitted to the measured rows and extrapolated to 1k and 10k devices (``benchmarks.fleet_model``);
rows say ``measured`` true or false.

    python -m benchmarks fleet            # N = 10, 25, 50, the largest that fits; dropout; real devices
    python -m benchmarks fleet --quick    # N = 2 and 4 replay devices, short windows (the test's)
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Goal, Options, Section, ratio  # noqa: E402
from benchmarks.fleet_model import EXTRAPOLATE_TO, extrapolate, fit, plot  # noqa: E402
from benchmarks.fleet_run import FleetPlan, FleetResult, RealDevices, deploy_fleet, make_certs  # noqa: E402
from benchmarks.sections_cli import section_main, show_ratios  # noqa: E402

SIZES = {"full": (10, 25, 50), "quick": (2, 4)}  # stages of one deployment (devices added between them)
WINDOW = {"full": 40.0, "quick": 10.0}  # measured seconds once every device got work
ROUND_TIMEOUT = 40.0  # [server] round_timeout: a vanished device's message is forgotten after this
TRAIN_SECONDS = (8.0, 12.0)  # a replay device's "training" per update (uniform): a light device's pace
DROPOUT = {"fraction": 0.1, "window": 60.0}  # full only: after the largest fleet's window, in one more
REPLAY_MB = 190.0  # resident MB per replay device (SuperNode and its share of a replay process; measured)
MAX_DEVICES = 100  # the largest replay fleet tried (time: ~3 min to start and measure on 2 cores)
REAL_MAX = 4  # real edge-client join devices at most (each ~1 GB: torch, ONNX Runtime)
REAL_MB = 1200.0  # resident MB assumed per real device when choosing how many fit
# Dropouts as fleets handle them (docs/howto/buffered.md, "Dropouts and over-selection"): concurrency is the
# devices a version wants training, over-selected by 130% so every device is busy, and a version that waited
# round_timeout closes with what arrived (at least min_buffer updates).
OVER_SELECTION = 1.3
EXTRA_SERVER_KEYS: dict[str, object] = {"over_selection": OVER_SELECTION, "min_buffer": 1}
SERVER_ROLES = ("SuperLink", "ServerApp", "SuperExec", "serve and join")


def server_table(devices: int, extra: dict[str, object] | None = None) -> str:
    """The preset's [server] table for ``devices``: only existing keys (fedmvp/presets/server.py), then
    ``extra`` (``EXTRA_SERVER_KEYS``: keys this benchmark passes through unchanged, e.g. over-selection
    or closing a version with what arrived, once the server has them)."""
    keys: dict[str, object] = {"concurrency": max(1, int(devices / OVER_SELECTION)), "buffer_size": max(2, min(10, devices // 5)), "max_staleness": 20,
                               "round_timeout": ROUND_TIMEOUT, **(extra or {})}
    body = "\n".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in keys.items())
    return f"\n[server]\n{body}\n"


def preset_for(work: Path, devices: int) -> Path:
    from fedmvp.presets.schema import preset_path

    path = work / f"fleet-{devices}.toml"
    path.write_text(preset_path("demo").read_text() + server_table(devices, EXTRA_SERVER_KEYS))
    return path


def available_mb() -> float:
    """MemAvailable (/proc/meminfo) in MB; 0 where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def row(result: FleetResult) -> dict:
    """One measured run as a table row."""
    plan, minutes = result.plan, result.seconds / 60.0
    accepted = max(result.accepted, 0)
    superlink = result.cpu.get("SuperLink", 0.0)
    server = sum(result.cpu.get(r, 0.0) for r in SERVER_ROLES)
    lat = result.latency
    return {"run": f"{plan.kind} N={plan.devices}" + (f", {plan.vanish} vanish" if plan.vanish else ""),
            "kind": plan.kind, "devices": plan.devices, "measured": True, "window_s": round(result.seconds, 1),
            "accepted_updates": accepted, "versions": result.versions,
            "updates_per_min": accepted / minutes if minutes else 0.0,
            "superlink_cpu_s_per_update": ratio(superlink, accepted), "server_cpu_s_per_update": ratio(server, accepted),
            "superlink_cpu_s_per_min": superlink / minutes if minutes else 0.0,
            # where the rest went (a stalled fleet: is it the ServerApp, or the devices' side?)
            "serverapp_cpu_s_per_min": result.cpu.get("ServerApp", 0.0) / minutes if minutes else 0.0,
            "devices_cpu_s_per_min": result.cpu.get("devices", 0.0) / minutes if minutes else 0.0,
            "superlink_rss_mb": result.rss_mb.get("SuperLink", 0.0),
            "server_rss_mb": sum(result.rss_mb.get(r, 0.0) for r in SERVER_ROLES if r != "SuperLink"),
            "rss_mb_per_device": result.rss_mb.get("devices", 0.0) / plan.devices,
            "latency_median_s": statistics.median(lat) if lat else None, "latency_max_s": max(lat) if lat else None,
            "version_wait_max_s": max(result.version_seconds) if result.version_seconds else None,
            "timed_out": result.timed_out, "left_out": len(result.rejected), "vanished_devices": result.vanished,
            "start_s": result.messages.get("start_seconds")}


def largest_fleet(per_device_mb: float, measured: int) -> tuple[int | None, str]:
    """The largest replay fleet to try beyond ``SIZES``: half of MemAvailable over the MB per device
    (``REPLAY_MB``, and each row reports the measured figure), in steps of 25, at most ``MAX_DEVICES``;
    None when it is not above ``measured``."""
    free = available_mb()
    fits = int(0.5 * free / per_device_mb) if per_device_mb > 0 else 0
    chosen = min(MAX_DEVICES, fits // 25 * 25)
    why = (f"MemAvailable {free:.0f} MB at the start, {per_device_mb:.0f} MB per replay device: half of it holds "
           f"{fits}; tried {chosen if chosen > measured else 'none beyond ' + str(measured)} (at most {MAX_DEVICES} "
           f"for the time budget)")
    return (chosen if chosen > measured else None), why


def run(options: Options) -> Section:
    began = time.perf_counter()
    kind = "quick" if options.quick else "full"
    sizes, window = list(SIZES[kind]), WINDOW[kind]
    section = Section(name="fleet", config={"transport": "TLS on 127.0.0.1, a node key per device (--node-keys)",
                                            "mode": "buffered", "round_timeout_s": ROUND_TIMEOUT, "window_s": window,
                                            "cpu_cores": os.cpu_count(), "extra_server_keys": EXTRA_SERVER_KEYS})
    results: list[FleetResult] = []
    with tempfile.TemporaryDirectory(prefix="fedmvp-bench-fleet-") as tmp:
        work = Path(tmp)
        if not options.quick:  # the largest fleet: as many as memory holds (REPLAY_MB each), decided first
            biggest, section.config["largest_fleet"] = largest_fleet(REPLAY_MB, max(sizes))
            sizes += [biggest] if biggest else []
        certs = make_certs(work / "certs", max(sizes))
        plan = FleetPlan(max(sizes), window, stages=tuple(sizes), train_seconds=TRAIN_SECONDS)
        if not options.quick:  # then 10% of the largest fleet die mid-update, in the same deployment
            plan.vanish = max(1, round(plan.devices * DROPOUT["fraction"]))
            plan.vanish_window = DROPOUT["window"]
        results += deploy_fleet(plan, preset_for(work, max(sizes)), certs, work / "replay")
        if not options.quick:
            try:
                results += real_run(work, certs, window, section)
            except Exception as err:  # noqa: BLE001 - the replay figures stand without it; said in the notes
                section.notes.append(f"FAILED: the real-device run: {type(err).__name__}: {' '.join(str(err).split())[:300]}")
    rows = [row(r) for r in results]
    section.rows += rows
    scaling = [r for r in rows if r["kind"] == "replay" and not r["vanished_devices"] and r["accepted_updates"]]
    model = fit(scaling)
    section.config["model"] = model
    section.rows += [extrapolate(model, n) for n in EXTRAPOLATE_TO]
    ratios(section, results, scaling)
    section.notes += [
        "replay devices: real SuperNodes (TLS, own node key) whose ClientApp replays a device's reply (real-sized "
        "LoRA + a small delta, identity, bundle id, train metrics), accepted by the server's own checks; the "
        "server side, which is what is measured, cannot tell them from real devices",
        "rows with measured=false are extrapolated from the fitted model (config.model), not measured",
        "CPU and resident memory from /proc over the window; latency: a device's reply to the checkpoint of the "
        "version that used it; version_wait_max_s: the longest a version gathered (state.json seconds)",
        "objects per message: Flower objects of each train message and its reply, counted on the device "
        "(flwr get_all_nested_objects: the encoding in place); the SuperLink's SQLite object table is read "
        "after each run too (sqlite_objects_left: Flower deletes objects once delivered)"]
    section.seconds = time.perf_counter() - began
    out = options.out or REPO / "benchmarks" / "results" / time.strftime("fleet-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    png = plot(section.to_json(), out / "fleet.png")
    section.config["plot"] = str(png) if png else None
    return section


def real_run(work: Path, certs: Path, window: float, section: Section) -> list[FleetResult]:
    """Real `edge-client join` devices, as many as memory holds (at most ``REAL_MAX``)."""
    from benchmarks.async_rounds import device_folders, prepare

    count = min(REAL_MAX, int(0.5 * available_mb() / REAL_MB))
    section.config["real_devices"] = f"{count} (MemAvailable {available_mb():.0f} MB, {REAL_MB:.0f} MB each assumed)"
    if count < 1:
        return []
    real = work / "real"
    real.mkdir()
    template, bundle, local, _, classes = prepare(real, 100000, server_table(count, EXTRA_SERVER_KEYS), None)
    folders = device_folders(local, classes, count, real)
    devices = RealDevices(template, bundle, folders)
    return deploy_fleet(FleetPlan(count, 1.5 * window, kind="real", start_timeout=400.0), real / "devices.toml", certs,
                        real / "deploy", devices)


def ratios(section: Section, results: list[FleetResult], scaling: list[dict]) -> None:
    at = next((r for r in scaling if r["devices"] == 50), max(scaling, key=lambda r: r["devices"], default=None))
    section.config["cpu_per_update_at_devices"] = at["devices"] if at else None
    section.ratios["superlink_cpu_s_per_update_at_50"] = at["superlink_cpu_s_per_update"] if at else None
    objects = [(r.objects.get("train_in"), r.objects.get("train_reply")) for r in results if r.objects]
    flat = [x for pair in objects for x in pair if x is not None]
    section.ratios["objects_per_message"] = statistics.median(flat) if flat else None
    section.config["objects_train_message_and_reply"] = objects
    section.config["sqlite_objects_left"] = [r.sqlite_objects for r in results]
    biggest = max(scaling, key=lambda r: r["devices"], default=None)
    section.ratios["updates_per_minute_per_core"] = (60.0 / biggest["server_cpu_s_per_update"]
                                                     if biggest and biggest["server_cpu_s_per_update"] else None)
    section.config["updates_per_minute_per_core_means"] = (
        "accepted updates one core of server-side CPU (SuperLink, ServerApp, SuperExec, serve) takes per minute "
        f"at N={biggest['devices'] if biggest else None}: 60 / server CPU-s per update")
    drop = next((r for r in section.rows if r.get("vanished_devices")), None)
    if drop is not None and drop["version_wait_max_s"] is not None:
        section.goals.append(Goal.at_most("dropout: longest version wait / round_timeout",
                                          drop["version_wait_max_s"] / ROUND_TIMEOUT, 1.0))


def show(section: Section) -> None:
    c = section.config
    print(f"fleet: {c['transport']}; window {c['window_s']:.0f} s; {c.get('largest_fleet', '')}")
    print(f"{'run':<28} {'N':>6} {'upd/min':>8} {'SL cpu/upd':>10} {'SL MB':>7} {'srv MB':>7} {'MB/dev':>7} "
          f"{'lat med':>7} {'wait max':>8} {'t/o':>4} {'meas':>5}")
    for r in section.rows:
        def f(key: str, fmt: str) -> str:
            return format(r[key], fmt) if r.get(key) is not None else "-"
        print(f"{r['run']:<28} {r['devices']:>6} {f('updates_per_min', '8.1f')} {f('superlink_cpu_s_per_update', '10.3f')} "
              f"{f('superlink_rss_mb', '7.0f')} {f('server_rss_mb', '7.0f')} {f('rss_mb_per_device', '7.0f')} "
              f"{f('latency_median_s', '7.2f')} {f('version_wait_max_s', '8.1f')} {f('timed_out', '4d')} "
              f"{'yes' if r['measured'] else 'extrap':>5}")
    show_ratios(section)


def main(argv: list[str] | None = None) -> int:
    return section_main(run, show, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
