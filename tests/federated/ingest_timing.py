"""How long `fedmvp ingest` takes per update file (docs/howto/regions.md quotes it).

`python -m tests.federated.ingest_timing [FILES] [REPEATS]`: the tiny run of tests/run_fixtures.py (tiny CLIP,
LoRA rank 4), FILES device update files (edge_client.update.write_update) ingested in one call of
``fedmvp.federated.ingest.ingest`` onto a fresh copy of the run, REPEATS times; prints one JSON line with the
median wall time per file and the whole call's. The import of torch and the CLI's start are not in it.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(files: int = 200, repeats: int = 3) -> dict:
    from fedmvp.federated.ingest import ingest
    from fedmvp.runs import RunDir
    from tests.federated.test_ingest import RUN_ID, configure, good_update, lora_of, round_promptformer
    from tests.run_fixtures import write_run

    root = Path(tempfile.mkdtemp(prefix="ingest-timing-"))
    try:
        write_run(root / "base", root / "preset.toml", "", "timing")
        configure(root / "base", {})
        lora, digest = lora_of(root / "base"), round_promptformer(root / "base", 2)
        (root / "files").mkdir()
        rng = np.random.default_rng(0)  # each file its own training: a direction of its own, not a scaled copy
        paths = []
        for i in range(files):
            tensors = {k: (v + rng.normal(scale=1e-2, size=v.shape)).astype(np.float32) for k, v in lora.items()}
            paths.append(good_update(root / "files" / f"u{i}.st", lora, 0.0, 10, 1.0, promptformer=digest,
                                     run_id=RUN_ID, moved=tensors))
        walls = []
        for repeat in range(repeats):
            run = root / f"run{repeat}"
            shutil.copytree(root / "base", run)
            began = time.perf_counter()
            result = ingest(run, paths)
            walls.append(time.perf_counter() - began)
            assert result.round == 3 and len(result.accepted) == files, result.rejected[:1]
        wall = statistics.median(walls)
        lora_bytes = sum(v.nbytes for v in lora.values())
        return {"files": files, "repeats": repeats, "median_call_s": round(wall, 4),
                "median_ms_per_file": round(1000 * wall / files, 3), "lora_bytes": lora_bytes,
                "rounds": RunDir(root / "run0").rounds(), "loadavg_1m": os.getloadavg()[0]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:3]))))
