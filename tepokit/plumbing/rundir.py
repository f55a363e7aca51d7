"""The run directory: its lock, seeds and RNG state, atomic and durable writes in strict JSON, checkpoints
and the metrics logs. The checks before --resume are in tepokit/cli/resume.py, summary.json and the lines a run
prints in tepokit/diagnostics/summary.py."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import tempfile
import time

import torch

from tepokit.plumbing.errors import fail, first_line
from tepokit.plumbing.hub import without_transformers_bars


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)          # also seeds CUDA; generation samples from this generator


# ---- the run directory's lock: one process owns a run directory for its lifetime -------------------------
# An OS file lock (fcntl.flock) on <run dir>/.lock: the kernel drops it when the process ends, however it
# ends (kill -9 too), so a dead run never leaves a stale lock. The file holds the owner's process id, so a
# refusal can name it.
LOCK_FILE = ".lock"
RUN_FILES = ("config.json", "metrics.jsonl", "details.jsonl", "completions.jsonl", "checkpoint.pt", "summary.json")


def holds_a_run(run_dir: str) -> bool:
    """Whether a directory holds a run, finished or interrupted: a log or checkpoint, or a config.json that is a
    run's (it has the run's args), not a model's. (A summary.json alone is --compare's, not a run's.)"""
    if any(os.path.exists(os.path.join(run_dir, name)) for name in ("metrics.jsonl", "details.jsonl", "checkpoint.pt")):
        return True
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return "args" in json.load(f)
    except (OSError, ValueError, TypeError):      # none, unreadable, not JSON, not an object: not a run's
        return False


def holds_other_files(run_dir: str) -> bool:
    """Whether a directory that holds no run holds anything but the lock of a run that stopped before writing
    (a model directory, say): a run is not written among other files, and --overwrite replaces only a run."""
    return (os.path.isdir(run_dir) and not holds_a_run(run_dir)
            and any(name != LOCK_FILE for name in os.listdir(run_dir)))


def lock_file(path: str, what: str, wait: bool = False):
    """Take the OS lock of `path` (created if needed) and write our process id into it; returns the open
    file, which holds the lock until it is closed or the process ends. If another process holds it:
    wait for it (wait=True, for caches) or refuse in one line naming that process and `what` it guards."""
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        if not wait:
            f.close()
            fail(f"{what} is in use by process {owner} (it holds {path}); wait for it to end, or choose another "
                 "directory")
        print(f"waiting for process {owner}, which is writing {what}", flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def claim_run_dir(run_dir: str, resume: bool, overwrite: bool = False):
    """Make `run_dir` this process's for its lifetime: create it, take its lock, and refuse (one line) a
    directory that holds a finished or interrupted run unless resuming it or told to --overwrite it (then
    the old run's files are removed, under the lock). Returns the lock; closing it releases the directory.
    A directory that holds other files and no run is refused, and left as it is."""
    if holds_other_files(run_dir):
        fail(f"argument --out: {run_dir} holds files and no run of train_small.py (a model directory?); nothing "
             "in it is replaced, not even with --overwrite; choose a new or empty directory")
    os.makedirs(run_dir, exist_ok=True)
    sync_folder(os.path.dirname(os.path.abspath(run_dir)))     # the new directory's name on the disk
    lock = lock_file(os.path.join(run_dir, LOCK_FILE), f"run directory {run_dir}")
    if not resume and holds_a_run(run_dir):
        if not overwrite:
            lock.close()
            fail(f"argument --out: {run_dir} holds a run already; continue it with --resume {run_dir}, choose "
                 "another --out, or add --overwrite to replace it")
        for name in [*RUN_FILES, "policy"]:
            target = os.path.join(run_dir, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.remove(target)
    return lock


# ---- strict JSON: every file the project writes parses with a strict parser ---------------------------
def strict(value):
    """`value` with every NaN and infinity replaced by None (null): JSON has no NaN, and strict parsers
    (JavaScript, jq, Go) reject a file that holds one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def to_json(value, **kwargs) -> str:
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def write_json(path: str, value) -> None:
    """A JSON file, strict and written atomically."""
    write_atomically(path, lambda f: f.write((to_json(value, indent=2) + "\n").encode()))


def fingerprint(value) -> str:
    """A short hash of any JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def run_identity(objective: str, model, tokenizer, data: str) -> dict:
    """What a checkpoint must agree with to be resumed: the objective, the model's shape (each parameter's
    name and shape), the tokenizer (its vocabulary) and the data set (`data`, its content hash). Written to
    config.json and into every checkpoint."""
    return {"objective": objective,
            "model_shape": fingerprint(sorted((k, list(v.shape)) for k, v in model.state_dict().items())),
            "tokenizer": fingerprint(sorted(tokenizer.get_vocab().items())), "data": data}


def lock_holder(run_dir: str) -> str | None:
    """The process id that holds a run directory's lock, or None; only looks (creates nothing)."""
    path = os.path.join(run_dir, LOCK_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "another process"
    return None


def save_pretrained_atomically(model, tokenizer, final_dir: str) -> None:
    """save_pretrained into a temporary directory, made durable (sync_tree), then os.replace: a crash, a
    kill or a power loss never leaves half a model. The caller holds the lock that guards `final_dir`
    (the run directory's, the warm-up cache entry's), so a temporary directory of an earlier write of the
    same directory (.tmp-<name>-*) is a leftover of a writer that was killed: it is removed first."""
    parent, name = os.path.dirname(final_dir) or ".", os.path.basename(final_dir)
    os.makedirs(parent, exist_ok=True)
    for stale in os.listdir(parent):
        if stale.startswith(f".tmp-{name}-"):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{name}-")
    try:
        os.chmod(tmp, 0o777 & ~current_umask())      # mkdtemp makes it private (0700); a shared cache is not
        with without_transformers_bars():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        for root, _, files in os.walk(tmp):      # safetensors writes model.safetensors private (0600) too
            for name in files:
                os.chmod(os.path.join(root, name), 0o666 & ~current_umask())
        sync_tree(tmp)
    except BaseException as e:         # nothing half-written stays; a failed write is an OSError (one line)
        shutil.rmtree(tmp, ignore_errors=True)
        code = re.search(r"os error (\d+)", str(e))     # safetensors reports the OS's error in its own type
        if code and not isinstance(e, OSError):
            raise OSError(int(code[1]), first_line(e), final_dir) from e
        if isinstance(e, OSError):
            raise with_path(e, final_dir) from e
        raise
    if os.path.isdir(final_dir):       # someone else finished first, or an old copy: replace it
        shutil.rmtree(final_dir)
    os.replace(tmp, final_dir)
    sync_folder(parent)


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


# ---- durability: what the disk holds after a power loss or a kernel crash ---------------------------------
# A rename is atomic, but the kernel may write it to the disk before the file's data: after a crash the new
# name can point at an empty or truncated file. fsync on the file before the rename, and on its folder after
# it, makes the order the disk sees the order the program meant. The cost per checkpoint is in
# docs/reliability.md.

def sync_file(path: str) -> None:
    """Wait until the data of the file at `path` are on the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:               # a full disk can surface here, where the error names no file
        raise with_path(e, path) from e
    finally:
        os.close(fd)


def sync_folder(folder: str) -> None:
    """Wait until the names in `folder` (files created, renamed or removed in it) are on the disk."""
    sync_file(folder or ".")           # a folder opens read-only like a file; its fsync writes its entries


def sync_tree(folder: str) -> None:
    """sync_file on every file below `folder`, then sync_folder on every folder, deepest first."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            sync_file(os.path.join(root, name))
        sync_folder(root)


def current_umask() -> int:
    """The process's umask (os.umask can only be read by setting it, so it is set back at once). The files of a
    run and of the warm-up cache get the permissions any file the user creates gets: a teacher can read a
    student's run, and users who share a --cache-dir share its entries."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str, write) -> None:
    """write(f) into a temp file next to `path`, then os.replace it: a reader, a crash or a kill -9
    finds the old file or the new one, never half of one. Durable too (sync_file, sync_folder): the data reach
    the disk before the rename, and the rename after it, so a power loss or a kernel crash finds the
    old file or the whole new one. Temp files of writes killed before (named .<name>-*) are removed
    first."""
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    for stale in os.listdir(folder):
        if stale.startswith(f".{name}-"):
            os.remove(os.path.join(folder, stale))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}-")
    try:
        os.chmod(tmp, 0o666 & ~current_umask())      # mkstemp makes it private (0600); a run's files are not
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())       # the data on the disk before the name points at them
        os.replace(tmp, path)
    except BaseException as e:     # an exception or Ctrl-C: no temp file left behind
        os.remove(tmp)
        if isinstance(e, OSError):
            raise with_path(e, path) from e
        raise
    sync_folder(folder)                # the rename on the disk


def frozen_names(model) -> set[str]:
    """The state_dict names of the parameters that do not train (LoRA's base weights; tied weights under each of
    their names)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(model) -> dict:
    """What a checkpoint keeps of the model: its whole state_dict, or, when some parameters are frozen (LoRA,
    tepokit/setup/lora.py), all but those: the adapters. The frozen base is the start model, which --resume loads
    again, so a checkpoint of a 3B model's LoRA run weighs megabytes, not 12 GB."""
    frozen = frozen_names(model)
    return {name: tensor for name, tensor in model.state_dict().items() if name not in frozen}


def save_checkpoint(run_dir: str, model, optimizer, step: int, identity: dict) -> None:
    """model (its trained_state), optimizer, RNG states, step and the run's identity (run_identity), in
    checkpoint.pt, written atomically (write_atomically): if the write fails (a full disk, a file-size limit), the
    previous checkpoint is still there, whole. For the kill tests only: TEPO_TEST_CHECKPOINT_SLEEP=<seconds> sleeps
    after writing the temp file and before replacing checkpoint.pt, so that a test can kill the process in
    the middle of a write."""
    path = os.path.join(run_dir, "checkpoint.pt")
    # --resume needs the logs up to the checkpoint: on the disk first
    for log in ("metrics.jsonl", "details.jsonl", "completions.jsonl"):
        if os.path.exists(os.path.join(run_dir, log)):
            sync_file(os.path.join(run_dir, log))

    def write(f):
        try:
            torch.save({"model": trained_state(model), "optimizer": optimizer.state_dict(), "rng": rng_state(),
                        "step": step, "identity": identity}, f)
        except RuntimeError as e:     # torch reports a failed write ("PytorchStreamWriter failed writing file")
            raise OSError(errno.EIO, f"the write failed ({first_line(e)})", path) from e
        time.sleep(float(os.environ.get("TEPO_TEST_CHECKPOINT_SLEEP", 0)))
    write_atomically(path, write)


def load_checkpoint(run_dir: str, model, optimizer) -> int:
    """The model, optimizer and RNG states of a run directory's checkpoint.pt, loaded into `model` and
    `optimizer` and set; returns its step."""
    checkpoint = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    # strict but for the frozen parameters, which a checkpoint leaves out (trained_state)
    missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
    if unexpected or set(missing) - frozen_names(model):
        fail(f"--resume {run_dir}: checkpoint.pt does not hold this model's trained parameters ("
             f"{len(set(missing) - frozen_names(model))} missing, {len(unexpected)} unexpected); it is another "
             "model's")
    optimizer.load_state_dict(checkpoint["optimizer"])
    set_rng_state(checkpoint["rng"])
    return checkpoint["step"]


def append_row(path: str, row: dict) -> None:
    """One JSON row at the end of a .jsonl log, flushed: an interrupted run keeps every finished step. A failed
    write (a full disk) names the log, so that the one line said of it names the file and the resume command."""
    try:
        with open(path, "a") as f:
            f.write(to_json(row) + "\n")
            f.flush()
    except OSError as e:
        raise with_path(e, path) from e


def with_path(e: OSError, path: str) -> OSError:
    """`e` itself if it names its file; else the same error naming `path` (a write or flush on an open file
    raises without the file's name)."""
    return e if e.filename else OSError(e.errno, e.strerror or first_line(e), path)


class DamagedLog(ValueError):
    """A .jsonl log with a line that is not JSON (other than a cut-off last line), in one line naming it. The
    commands say it as their one-line error; a notebook gets the exception."""


def read_log(path: str) -> list[dict]:
    """The rows of a .jsonl log (none if it does not exist yet). A last line without its newline is a
    row whose write was cut off (kill -9): it is left out. Any other bad line raises DamagedLog.
    A metric written as null (how strict JSON writes NaN) is read back as NaN; `sample` (details.jsonl)
    stays None."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]        # the piece after the last newline is "" or a cut-off row
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DamagedLog(f"{path}, line {number}: not a JSON row ({e.msg}, column {e.colno}); the log is "
                             "damaged") from None
        if isinstance(row, dict):
            row = {k: math.nan if v is None and k != "sample" else v for k, v in row.items()}
        rows.append(row)
    return rows


def truncate_log(path: str, first_step: int) -> None:
    """On resume: keep a log's whole rows from before the checkpoint's next step (step < first_step),
    dropping later rows (said in one line) and a cut-off last line; rewritten atomically, so a resumed log
    never holds a half-written line or a step twice."""
    rows = read_log(path)
    kept = [r for r in rows if r["step"] < first_step]
    if len(kept) < len(rows):
        print(f"{os.path.basename(path)}: {len(rows) - len(kept)} row(s) after step {first_step - 1}, the "
              "checkpoint's step, are dropped; the resumed run computes them again")
    write_atomically(path, lambda f: f.write("".join(to_json(r) + "\n" for r in kept).encode()))


def utc_now() -> str:
    """The time now, to the second, in UTC: 2026-11-27T12:00:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def code_version() -> dict:
    """The code that runs: its git commit and whether tracked files differ from it ({"commit": None, ...} outside a
    git clone). config.json records it at the start, summary.json at the end: a run's files then say what made them
    and when, so that "designed before its runs" can be checked against the commits."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head, changes = (subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True, timeout=30)
                         for cmd in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"]))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "uncommitted_changes": None}
    if head.returncode != 0 or changes.returncode != 0:
        return {"commit": None, "uncommitted_changes": None}
    return {"commit": head.stdout.strip(), "uncommitted_changes": bool(changes.stdout.strip())}


def start_logs(run_dir: str, config: dict, logs: list[str]) -> None:
    """A fresh run: its config.json (what --resume reads back), stamped with its start time and code, and its
    logs, created empty."""
    write_json(os.path.join(run_dir, "config.json"), {**config, "started_at": utc_now(), "code": code_version()})
    for path in logs:
        open(path, "w").close()


def resume_from_checkpoint(run_dir: str, model, optimizer, logs: list[str]) -> int:
    """A resumed run: the model, optimizer and RNG states of its checkpoint.pt loaded, and its logs cut back to
    the rows before the checkpoint's next step (truncate_log). Returns that step, the first one to run."""
    first_step = load_checkpoint(run_dir, model, optimizer) + 1
    for path in logs:
        truncate_log(path, first_step)
    return first_step


def run_name(args) -> str:
    task = args.task if args.dataset is None else os.path.basename(args.dataset.rstrip("/")).replace(".jsonl", "")
    return f"{task}__{args.objective}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
