"""The run directory: seeds and RNG state, atomic writes, checkpoints, the metrics logs, summary.json,
the checks before --resume, and Ctrl-C that finishes the step."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import zipfile

import torch

import tepo
from tepokit.errors import fail, first_line
from tepokit.stats import accuracy_auc, pearson

def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)          # also seeds CUDA; generation samples from this generator


def check_resumable(run_dir: str, Args) -> tuple[dict, int]:
    """(saved config.json, step of checkpoint.pt) of a run directory that --resume can continue.
    Otherwise one line saying why not. Only reads: nothing on disk changes either way."""
    config_path, ckpt_path = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "checkpoint.pt")
    if not os.path.isfile(config_path):
        fail(f"argument --resume: {run_dir!r} has no config.json; give a run directory of train_small.py")
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"argument --resume: {config_path} is damaged ({type(e).__name__}: {first_line(e)}); "
             "the run cannot be resumed (nothing was changed)")
    if not (isinstance(saved, dict) and isinstance(saved.get("args"), dict)
            and isinstance(saved.get("objective_overrides"), dict)):
        fail(f"argument --resume: {config_path} is not a run configuration of train_small.py "
             "(it needs args and objective_overrides); the run cannot be resumed (nothing was changed)")
    unknown = sorted(set(saved["args"]) - set(Args.__dataclass_fields__)
                     | set(saved["objective_overrides"]) - set(tepo.ObjectiveConfig.__dataclass_fields__))
    if unknown:
        fail(f"argument --resume: {config_path} has settings this version of train_small.py does not know "
             f"({', '.join(unknown)}); the run cannot be resumed (nothing was changed)")
    if not os.path.isfile(ckpt_path):
        fail(f"argument --resume: {run_dir!r} has no checkpoint.pt: the run stopped before its first "
             "checkpoint; start it again without --resume (nothing was changed)")
    try:      # the zip checksums catch damaged tensor data; the load (memory-mapped) the rest
        with zipfile.ZipFile(ckpt_path) as z:
            damaged_member = z.testzip()
        if damaged_member is not None:
            raise ValueError(f"checksum mismatch in {damaged_member}")
        step = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception as e:  # noqa: BLE001 -- whatever is wrong with the file, the answer is one line
        fail(f"argument --resume: {ckpt_path} is damaged ({type(e).__name__}: {first_line(e)}); "
             "the run cannot be resumed (nothing was changed)")
    return saved, int(step)


def ctrl_c_finishes_the_step(run_dir: str):
    """Make Ctrl-C (SIGINT) stop the RL loop cleanly. Returns (interrupted, restore): interrupted()
    says whether Ctrl-C was pressed; the loop then finishes the step, logs and checkpoints it, and
    exits with status 130. A second Ctrl-C aborts at once (the run resumes from its last checkpoint).
    restore() puts the previous handler back."""
    pressed = []

    def handler(signum, frame):
        if pressed:
            print(f"aborted; resume from the last checkpoint with: python train_small.py --resume {run_dir}",
                  file=sys.stderr)
            raise SystemExit(130)
        pressed.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:                 # not the main thread: Ctrl-C keeps its usual meaning
        return (lambda: False), (lambda: None)
    return (lambda: bool(pressed)), (lambda: signal.signal(signal.SIGINT, previous))


def save_pretrained_atomically(model, tokenizer, final_dir: str) -> None:
    """save_pretrained into a temporary directory, then os.replace: a crash never leaves half a model."""
    parent = os.path.dirname(final_dir) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(final_dir):       # someone else finished first, or an old copy: replace it
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_atomically(path: str, write) -> None:
    """write(f) into a temp file next to `path`, then os.replace it: a reader, a crash or a kill -9
    finds the old file or the new one, never half of one. Temp files of writes killed before (named
    .<name>-*) are removed first."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    for stale in os.listdir(folder):
        if stale.startswith(f".{name}-"):
            os.remove(os.path.join(folder, stale))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:          # an exception or Ctrl-C: no temp file left behind
        os.remove(tmp)
        raise


def save_checkpoint(run_dir: str, model, optimizer, step: int) -> None:
    """model, optimizer, RNG states and step, in checkpoint.pt, written atomically (write_atomically).
    For the kill tests only: TEPO_TEST_CHECKPOINT_SLEEP=<seconds> sleeps after writing the temp file
    and before replacing checkpoint.pt, so that a test can kill the process in the middle of a write."""
    def write(f):
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state(),
                    "step": step}, f)
        time.sleep(float(os.environ.get("TEPO_TEST_CHECKPOINT_SLEEP", 0)))
    write_atomically(os.path.join(run_dir, "checkpoint.pt"), write)


def append_row(path: str, row: dict) -> None:
    """One JSON row at the end of a .jsonl log, flushed: an interrupted run keeps every finished step."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()


def read_log(path: str) -> list[dict]:
    """The rows of a .jsonl log (none if it does not exist yet). A last line without its newline is a
    row whose write was cut off (kill -9): it is left out. Any other bad line is reported in one line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]        # the piece after the last newline is "" or a cut-off row
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            fail(f"{path}, line {number}: not a JSON row ({e.msg}, column {e.colno}); the log is damaged")
    return rows


def truncate_log(path: str, first_step: int) -> None:
    """On resume: keep a log's whole rows from before the checkpoint's next step (step < first_step),
    dropping later rows and a cut-off last line; rewritten atomically, so a resumed log never holds a
    half-written line or a step twice."""
    rows = [r for r in read_log(path) if r["step"] < first_step]
    write_atomically(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()))


def run_name(args) -> str:
    task = "arith" if args.dataset is None else os.path.basename(args.dataset.rstrip("/")).replace(".jsonl", "")
    return f"{task}__{args.objective}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def write_summary(run_dir: str, rows: list[dict], args, wall: float) -> dict:
    """summary.json: start and final held-out accuracy, its area under the curve, final pass@k,
    entropy-change correlation, wall time."""
    evals = [r for r in rows if "eval/accuracy" in r]
    # Steps that made an update (DAPO's filter can skip one: no update, no entropy change to predict).
    steps = [r for r in rows
             if r["step"] > 0 and "entropy_change/predicted" in r and not r.get("dynamic_sampling/skipped")]
    reached = [r["step"] for r in evals if r["eval/accuracy"] >= args.target_accuracy]
    position_corrs = sorted(c for r in steps if math.isfinite(c := r.get("entropy_change/position_corr", math.nan)))
    summary = {
        "run_dir": run_dir, "objective": args.objective, "seed": args.seed,
        "start_accuracy": evals[0]["eval/accuracy"], "final_accuracy": evals[-1]["eval/accuracy"],
        "gain_points": 100 * (evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]),
        "accuracy_auc": accuracy_auc([r["step"] for r in evals], [r["eval/accuracy"] for r in evals]),
        "final_accuracy_lenient": evals[-1]["eval/accuracy_lenient"],
        **{"final_" + k[len("eval/"):]: v for k, v in evals[-1].items() if k.startswith("eval/pass@")},
        "start_sampled_accuracy": evals[0][f"eval/mean@{args.pass_k}"],
        "final_sampled_accuracy": evals[-1][f"eval/mean@{args.pass_k}"],
        "steps_to_target": reached[0] if reached else None, "target_accuracy": args.target_accuracy,
        "final_entropy": steps[-1]["entropy"] if steps else None,
        "entropy_change_correlation": pearson([r["entropy_change/predicted"] for r in steps],
                                              [r["entropy_change/measured"] for r in steps]),
        "entropy_change_position_corr_median": position_corrs[len(position_corrs) // 2] if position_corrs else None,
        "wall_seconds": wall,
    }
    json.dump(summary, open(os.path.join(run_dir, "summary.json"), "w"), indent=2)
    print(f"held-out accuracy {summary['start_accuracy']:.3f} -> {summary['final_accuracy']:.3f} "
          f"({summary['gain_points']:+.1f} points, {summary['accuracy_auc']:.3f} averaged over the run); "
          f"sampled (T={args.temperature}) {summary['start_sampled_accuracy']:.3f} -> "
          f"{summary['final_sampled_accuracy']:.3f}, pass@{args.pass_k} {summary[f'final_pass@{args.pass_k}']:.3f}; "
          f"entropy change predicted vs measured: r = {summary['entropy_change_correlation']:.3f}; {wall:.0f} s; "
          f"{run_dir}")
    return summary
