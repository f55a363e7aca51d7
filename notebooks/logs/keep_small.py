"""Copy run directories into notebooks/logs/, committed small: config.json and summary.json as they are, and
metrics.jsonl with every row (every step and every evaluation), floats to 4 significant digits, without the keys
that say how fast or how large a run was on its machine (timing/, perf/, memory/, logprobs/, precision/,
step_time) and without the band/ counts that are 0 (a missing band/ count is 0). Checkpoints, the final policy and
details.jsonl stay behind.

    python notebooks/logs/keep_small.py SOURCE_DIR... DEST_DIR     # e.g. runs/band_mechanism_2026-11-27 notebooks/logs
"""
import json
import math
import os
import shutil
import sys

DROPPED = ("timing/", "perf/", "memory/", "logprobs/", "precision/", "step_time")


def small(value):
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        return float(f"{value:.4g}")
    return value


def small_row(row: dict) -> dict:
    return {k: small(v) for k, v in row.items()
            if not k.startswith(DROPPED) and not (k.startswith("band/") and v == 0)}


def keep_small(run_dir: str, dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for name in ("config.json", "summary.json"):
        shutil.copyfile(os.path.join(run_dir, name), os.path.join(dest, name))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f, open(os.path.join(dest, "metrics.jsonl"), "w") as out:
        for line in f:
            out.write(json.dumps(small_row(json.loads(line)), allow_nan=True) + "\n")


def main(argv: list[str]) -> None:
    *sources, dest_root = argv
    for source in sources:
        comparison = os.path.basename(os.path.normpath(source))
        for name in sorted(os.listdir(source)):
            run_dir = os.path.join(source, name)
            if os.path.exists(os.path.join(run_dir, "summary.json")):          # finished runs only
                keep_small(run_dir, os.path.join(dest_root, comparison, name))
        for name in ("summary.md", "summary.json"):                             # the comparison's own summary
            if os.path.exists(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(dest_root, comparison, name))


if __name__ == "__main__":
    main(sys.argv[1:])
