"""The run directory: its lock, seeds and RNG state, atomic writes in strict JSON, checkpoints, the metrics
logs, summary.json, and the checks before --resume (nothing is changed until they pass)."""

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
import tempfile
import time
import zipfile

import torch

import tepo
from tepokit.errors import fail, first_line
from tepokit.hub import without_transformers_bars
from tepokit.stats import MIN_STEPS_FOR_R, accuracy_auc, pearson, wald_half_width
from tepokit.task import HIDDEN_TYPES


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)          # also seeds CUDA; generation samples from this generator


# ---- the run directory's lock: one process owns a run directory for its lifetime -------------------------
# An OS file lock (fcntl.flock) on <run dir>/.lock: the kernel drops it when the process ends, however it
# ends (kill -9 too), so a dead run never leaves a stale lock. The file holds the owner's process id, so a
# refusal can name it.
LOCK_FILE = ".lock"
RUN_FILES = ("config.json", "metrics.jsonl", "details.jsonl", "checkpoint.pt", "summary.json")


def holds_a_run(run_dir: str) -> bool:
    """Whether a directory holds a run, finished or interrupted (any file a run writes)."""
    return any(os.path.exists(os.path.join(run_dir, name)) for name in RUN_FILES)


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
    the old run's files are removed, under the lock). Returns the lock; closing it releases the directory."""
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


CANNOT_RESUME = "the run cannot be resumed (nothing was changed)"


def identity_differences(saved: dict, found: dict) -> list[str]:
    """The parts of a run's identity (run_identity) in which `found` differs from `saved`."""
    return [key for key, value in saved.items() if found.get(key) != value]


# Settings a config.json may lack (it was written before they existed), with the value that does what such a
# run did, so that --resume continues it with the same arithmetic: generate sampled, and the old log-probs were
# recomputed.
DEFAULTS_OF_OLDER_CONFIGS = {"sampler": "generate", "recompute_old_logprobs": True}


def check_resumable(run_dir: str, Args, run_only: tuple) -> tuple[dict, int]:
    """(saved config.json, step of checkpoint.pt) of a run directory that --resume can continue.
    Otherwise one line saying why not. Only reads: nothing on disk changes either way.

    Checked: config.json holds every setting the run needs (all of Args but the `run_only` ones, which
    come from the command line) and no unknown one; checkpoint.pt is whole and was written by this run
    (its identity: objective, model shape, tokenizer, data, equals config.json's); metrics.jsonl (and
    details.jsonl for TEPO) has one row per step from the start up to the checkpoint."""
    config_path, ckpt_path = os.path.join(run_dir, "config.json"), os.path.join(run_dir, "checkpoint.pt")
    if not os.path.isfile(config_path):
        fail(f"argument --resume: {run_dir!r} has no config.json; give a run directory of train_small.py")
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"argument --resume: {config_path} is damaged ({type(e).__name__}: {first_line(e)}); {CANNOT_RESUME}")
    if not (isinstance(saved, dict) and isinstance(saved.get("args"), dict)
            and isinstance(saved.get("objective_overrides"), dict)):
        fail(f"argument --resume: {config_path} is not a run configuration of train_small.py "
             f"(it needs args and objective_overrides); {CANNOT_RESUME}")
    unknown = sorted(set(saved["args"]) - set(Args.__dataclass_fields__)
                     | set(saved["objective_overrides"]) - set(tepo.ObjectiveConfig.__dataclass_fields__))
    if unknown:
        fail(f"argument --resume: {config_path} has settings this version of train_small.py does not know "
             f"({', '.join(unknown)}); {CANNOT_RESUME}")
    for name, value in DEFAULTS_OF_OLDER_CONFIGS.items():    # what a run saved before they existed did
        saved["args"].setdefault(name, value)
    missing = sorted(set(Args.__dataclass_fields__) - set(run_only) - set(saved["args"]))
    if missing:
        fail(f"argument --resume: {config_path} lacks settings the run needs ({', '.join(missing)}); {CANNOT_RESUME}")
    if not isinstance(saved.get("identity"), dict):
        fail(f"argument --resume: {config_path} does not record the run's model, tokenizer and data (it was "
             f"written by an older version of train_small.py); {CANNOT_RESUME}")
    if saved["args"].get("engine") == "trl":       # TRL's own checkpoints; its trainer state holds the logs
        return saved, check_trl_checkpoint(run_dir, saved)
    if not os.path.isfile(ckpt_path):
        fail(f"argument --resume: {run_dir!r} has no checkpoint.pt: the run stopped before its first "
             f"checkpoint; start it again with --out {run_dir} --overwrite (nothing was changed)")
    try:      # the zip checksums catch damaged tensor data; the load (memory-mapped) the rest
        with zipfile.ZipFile(ckpt_path) as z:
            damaged_member = z.testzip()
        if damaged_member is not None:
            raise ValueError(f"checksum mismatch in {damaged_member}")
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
        step, identity = int(checkpoint["step"]), checkpoint.get("identity") or {}
    except Exception as e:  # noqa: BLE001 -- whatever is wrong with the file, the answer is one line
        fail(f"argument --resume: {ckpt_path} is damaged ({type(e).__name__}: {first_line(e)}); {CANNOT_RESUME}")
    differ = identity_differences(saved["identity"], identity)
    if differ:
        fail(f"argument --resume: {ckpt_path} was not written by the run of {config_path}: its "
             f"{' and '.join(differ)} differ; {CANNOT_RESUME}")
    check_log(os.path.join(run_dir, "metrics.jsonl"), 0, step)
    if saved["args"]["objective"] == "tepo":
        check_log(os.path.join(run_dir, "details.jsonl"), 1, step)
    return saved, step


# ---- TRL's checkpoints: <run dir>/checkpoint-<optimizer step>/ ------------------------------------------
# The Trainer writes a checkpoint file by file, in this order: the model (model.safetensors, or shards listed
# by model.safetensors.index.json, with config.json), optimizer.pt, scheduler.pt, the RNG state (rng_state.pth,
# or rng_state_<process>.pth with several processes), trainer_state.json; then StopAtStepEnd (tepo_trl.py)
# writes identity.json. A process killed during the save leaves a checkpoint without its last files, or with a
# file cut short: --resume takes the newest WHOLE checkpoint instead. The other files (tokenizer, generation
# config, training_args.bin) are not needed to resume; the torch-saved ones among them are checked if present.
TRL_CHECKPOINT = re.compile(r"checkpoint-(\d+)")       # as transformers' own checkpoint search
TORCH_SAVED = (".pt", ".pth", ".bin")                  # zip files (torch.save)
PARSED_JSON = ("config.json", "model.safetensors.index.json", "trainer_state.json", "identity.json")


def safetensors_problem(path: str) -> str | None:
    """Why a .safetensors file is damaged, or None, without loading a tensor: the file is an 8-byte header
    length, a JSON header giving each tensor's data_offsets, then the data; a whole file ends where the
    last tensor's data ends."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            header_length = int.from_bytes(f.read(8), "little")
            if size < 8 + header_length:
                return f"is cut short ({size} bytes, shorter than its header)"
            header = json.loads(f.read(header_length))
        data_end = max((int(entry["data_offsets"][1]) for name, entry in header.items() if name != "__metadata__"),
                       default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:    # JSON errors are ValueErrors
        return f"is damaged (its header does not parse: {type(e).__name__})"
    if size != 8 + header_length + data_end:
        return f"is damaged ({size} bytes where its header says {8 + header_length + data_end})"
    return None


def zip_problem(path: str) -> str | None:
    """Why a torch-saved file (a zip file) is damaged, or None: its directory reads and every member's
    checksum matches (testzip reads the whole file, but loads nothing)."""
    try:
        with zipfile.ZipFile(path) as z:
            damaged_member = z.testzip()
    except Exception as e:  # noqa: BLE001 -- zipfile raises many types for a damaged file; the answer is one phrase
        return f"is damaged ({type(e).__name__}: {first_line(e)})"
    return None if damaged_member is None else f"is damaged (checksum mismatch in {damaged_member})"


def trl_checkpoint_problem(path: str) -> str | None:
    """Why TRL's checkpoint directory `path` cannot be resumed from, as "<file> is missing" or "<file> is
    damaged (...)", or None when it is whole. The files are looked at in the order the Trainer writes them,
    so a checkpoint cut off by a kill names the file whose write was interrupted."""
    present = set(os.listdir(path))
    weights = ["model.safetensors"]
    if "model.safetensors" not in present and "model.safetensors.index.json" in present:    # a sharded model
        weights = ["model.safetensors.index.json"]
        try:
            with open(os.path.join(path, weights[0])) as f:
                weights += sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{weights[0]} is damaged ({type(e).__name__}: {first_line(e)})"
    # one RNG file per process: rng_state.pth for one, rng_state_0.pth ... rng_state_<P-1>.pth for P
    processes = [int(m[1]) for name in present if (m := re.fullmatch(r"rng_state_(\d+)\.pth", name))]
    rng_states = [f"rng_state_{i}.pth" for i in range(max(processes) + 1)] if processes else ["rng_state.pth"]
    needed = [*weights, "optimizer.pt", "scheduler.pt", *rng_states, "trainer_state.json", "identity.json"]
    others = sorted(name for name in present - set(needed) if os.path.isfile(os.path.join(path, name)))
    for name in needed + others:
        file = os.path.join(path, name)
        if name not in present or not os.path.isfile(file):
            return f"{name} is missing"
        problem = None
        if name.endswith(".safetensors"):
            problem = safetensors_problem(file)
        elif name.endswith(TORCH_SAVED):
            problem = zip_problem(file)
        elif name in PARSED_JSON:
            try:
                with open(file) as f:
                    json.load(f)
            except (OSError, UnicodeDecodeError, ValueError) as e:
                problem = f"is damaged ({type(e).__name__}: {first_line(e)})"
        if problem:
            return f"{name} {problem}"
    return None


def newest_whole_trl_checkpoint(run_dir: str) -> tuple[tuple[str, int] | None, list[tuple[str, str]]]:
    """((path, optimizer step) of the newest whole checkpoint-<optimizer step> directory of a run directory,
    or None when none is whole; [(path, why)] of the newer ones skipped, newest first). Only reads."""
    found = sorted(((int(m[1]), os.path.join(run_dir, name)) for name in os.listdir(run_dir)
                    if (m := TRL_CHECKPOINT.fullmatch(name)) and os.path.isdir(os.path.join(run_dir, name))),
                   reverse=True)
    skipped = []
    for optimizer_step, path in found:
        problem = trl_checkpoint_problem(path)
        if problem is None:
            return (path, optimizer_step), skipped
        skipped.append((path, problem))
    return None, skipped


def set_aside_trl_checkpoints(paths: list[str]) -> list[str]:
    """Rename each incomplete checkpoint-N directory to incomplete-checkpoint-N, a name that neither
    transformers' search for checkpoints (glob "checkpoint-*", regex "^checkpoint-([0-9]+)$") nor ours
    matches: when the resumed run saves step N again, it writes a fresh checkpoint-N, with no stale file of the
    incomplete one mixed in. An incomplete-checkpoint-N set aside earlier is replaced. Returns the new paths."""
    renamed = []
    for path in paths:
        target = os.path.join(os.path.dirname(path), "incomplete-" + os.path.basename(path))
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(path, target)
        renamed.append(target)
    return renamed


def check_trl_checkpoint(run_dir: str, saved: dict) -> int:
    """The RL step of an --engine trl run's newest whole checkpoint (newest_whole_trl_checkpoint), after the
    same checks as checkpoint.pt's: one exists, it was written by this run (its identity.json equals
    config.json's), and metrics.jsonl holds the start model's evaluation (the rest of the log is in TRL's
    trainer state). Newer incomplete checkpoints are skipped here; tepo_trl.train sets them aside and says so."""
    newest, skipped = newest_whole_trl_checkpoint(run_dir)
    if newest is None and not skipped:
        fail(f"argument --resume: {run_dir!r} has no checkpoint-* directory: the run stopped before its first "
             f"checkpoint; start it again with --out {run_dir} --overwrite (nothing was changed)")
    if newest is None:
        incomplete = "; ".join(f"{os.path.basename(path)}: {why}" for path, why in skipped)
        fail(f"argument --resume: no checkpoint-* directory of {run_dir!r} is whole ({incomplete}); start the "
             f"run again with --out {run_dir} --overwrite (nothing was changed)")
    path, optimizer_step = newest
    with open(os.path.join(path, "identity.json")) as f:        # it parses: the checkpoint is whole
        identity = json.load(f)
    differ = identity_differences(saved["identity"], identity if isinstance(identity, dict) else {})
    if differ:
        fail(f"argument --resume: {path} was not written by the run of {run_dir}: its {' and '.join(differ)} "
             f"differ; {CANNOT_RESUME}")
    check_log(os.path.join(run_dir, "metrics.jsonl"), 0, 0)
    return optimizer_step // (saved["args"]["mini_batches"] * saved["args"]["epochs"])


def check_same_run(run_dir: str, identity: dict) -> None:
    """After loading, before anything changes: the model, tokenizer and data the resumed run has loaded
    must be the ones the run started with (config.json's identity); an edited data set or start model is
    refused in one line that names what changed."""
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)["identity"]
    differ = identity_differences(saved, identity)
    if differ:
        fail(f"argument --resume: the {' and '.join(differ)} loaded now differ from the ones {run_dir} started "
             f"with (was the data set or the start model changed?); {CANNOT_RESUME}")


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


def check_log(path: str, first_step: int, checkpoint_step: int) -> int:
    """A log --resume can continue: every row a JSON object with an integer step, the steps first_step,
    first_step + 1, ... with no gap and no repeat, up to at least the checkpoint's step. Returns how many
    rows lie after the checkpoint (the resumed run computes them again). Otherwise one line; only reads."""
    if not os.path.isfile(path):
        fail(f"argument --resume: {path} is missing; without it the run's record is incomplete; {CANNOT_RESUME}")
    try:
        rows = read_log(path)
    except DamagedLog as e:
        fail(f"argument --resume: {e}; {CANNOT_RESUME}")
    for number, row in enumerate(rows, 1):
        if not (isinstance(row, dict) and type(row.get("step")) is int):
            fail(f"argument --resume: {path}, line {number}: {json.dumps(row)[:60]} is not the row of a step (an "
                 f"object with an integer step); {CANNOT_RESUME}")
        if row["step"] != first_step + number - 1:
            fail(f"argument --resume: {path}, line {number}: step {row['step']} where step "
                 f"{first_step + number - 1} was expected (each step has one row, in order); {CANNOT_RESUME}")
    last = first_step + len(rows) - 1
    if last < checkpoint_step:
        fail(f"argument --resume: {path} ends at step {last} but checkpoint.pt is at step {checkpoint_step}: "
             f"steps are missing from the log; {CANNOT_RESUME}")
    return last - checkpoint_step


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
        with without_transformers_bars():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        sync_tree(tmp)
    except BaseException as e:         # nothing half-written stays; a failed write is an OSError (one line)
        shutil.rmtree(tmp, ignore_errors=True)
        code = re.search(r"os error (\d+)", str(e))     # safetensors reports the OS's error in its own type
        if code and not isinstance(e, OSError):
            raise OSError(int(code[1]), first_line(e), final_dir) from e
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
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())       # the data on the disk before the name points at them
        os.replace(tmp, path)
    except BaseException:          # an exception or Ctrl-C: no temp file left behind
        os.remove(tmp)
        raise
    sync_folder(folder)                # the rename on the disk


def save_checkpoint(run_dir: str, model, optimizer, step: int, identity: dict) -> None:
    """model, optimizer, RNG states, step and the run's identity (run_identity), in checkpoint.pt, written
    atomically (write_atomically): if the write fails (a full disk, a file-size limit), the previous
    checkpoint is still there, whole. For the kill tests only: TEPO_TEST_CHECKPOINT_SLEEP=<seconds> sleeps
    after writing the temp file and before replacing checkpoint.pt, so that a test can kill the process in
    the middle of a write."""
    path = os.path.join(run_dir, "checkpoint.pt")
    for log in ("metrics.jsonl", "details.jsonl"):   # --resume needs the log up to the checkpoint: on the disk first
        if os.path.exists(os.path.join(run_dir, log)):
            sync_file(os.path.join(run_dir, log))

    def write(f):
        try:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state(),
                        "step": step, "identity": identity}, f)
        except RuntimeError as e:     # torch reports a failed write ("PytorchStreamWriter failed writing file")
            raise OSError(errno.EIO, f"the write failed ({first_line(e)}): is the disk full?", path) from e
        time.sleep(float(os.environ.get("TEPO_TEST_CHECKPOINT_SLEEP", 0)))
    write_atomically(path, write)


def append_row(path: str, row: dict) -> None:
    """One JSON row at the end of a .jsonl log, flushed: an interrupted run keeps every finished step."""
    with open(path, "a") as f:
        f.write(to_json(row) + "\n")
        f.flush()


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


def run_name(args) -> str:
    task = args.task if args.dataset is None else os.path.basename(args.dataset.rstrip("/")).replace(".jsonl", "")
    return f"{task}__{args.objective}__{args.seed}__{time.strftime('%Y%m%d-%H%M%S')}"


def write_summary(run_dir: str, rows: list[dict], args, wall: float) -> dict:
    """summary.json: start and final held-out accuracy, its area under the curve, final pass@k,
    entropy-change correlation, wall time."""
    evals = [r for r in rows if "eval/accuracy" in r]
    # Steps that made an update (DAPO's filter can skip one: no update, no entropy change to predict), and
    # those of them that ran the entropy check (every --entropy-check-every steps).
    updated = [r for r in rows if r["step"] > 0 and not r.get("dynamic_sampling/skipped")]
    steps = [r for r in updated if "entropy_change/predicted" in r]
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
        "final_entropy": updated[-1]["entropy"] if updated else None,
        "entropy_change_correlation": pearson([r["entropy_change/predicted"] for r in steps],
                                              [r["entropy_change/measured"] for r in steps], MIN_STEPS_FOR_R),
        "entropy_change_position_corr_median": position_corrs[len(position_corrs) // 2] if position_corrs else None,
        "wall_seconds": wall,
    }
    rollouts = [r for r in rows if r["step"] > 0]      # every rollout, also those DAPO's filter left without update
    summary["entropy_start"], summary["entropy_end"] = first_and_last_means(rollouts, "entropy")
    if any("forks/entropy" in r for r in rollouts):     # the hidden-type task (tepokit/forks.py)
        summary["decision_entropy_start"], summary["decision_entropy_end"] = first_and_last_means(rollouts,
                                                                                                  "forks/entropy")
        summary["strategies_per_group_start"], summary["strategies_per_group_end"] = first_and_last_means(
            rollouts, "forks/strategies_per_group")
        by_type = [k for k in evals[-1] if k.startswith("eval/") and "/" in k[len("eval/"):]]   # eval/pass@2/add
        summary |= {"start_" + k[len("eval/"):]: evals[0][k] for k in by_type if k in evals[0]}
        summary |= {"final_" + k[len("eval/"):]: evals[-1][k] for k in by_type}
        formats = [r["format/valid"] for r in rollouts]     # one rollout: 128 samples; one evaluation: 1,600
        summary |= {"format_eval_min": min(r["eval/format"] for r in evals), "format_rollout_min": min(formats),
                    "format_rollout_mean": sum(formats) / len(formats)}
    if not math.isfinite(summary["entropy_change_correlation"]):       # null in the file: say why
        summary["entropy_change_correlation_missing"] = (f"too few steps: fewer than {MIN_STEPS_FOR_R} with a "
                                                         f"finite entropy check (--entropy-check-every)")
    write_json(os.path.join(run_dir, "summary.json"), summary)
    print_summary(summary, rows, args, wall)
    return summary


def first_and_last_means(rows: list[dict], key: str) -> tuple:
    """The means of `key` over the first and over the last tenth of the rows (at least 1, at most 10 rows
    each): one step's value is noisy. (None, None) when no row has it."""
    values = [r[key] for r in rows if math.isfinite(r.get(key, math.nan))]
    if not values:
        return None, None
    span = end_span(len(values))
    return sum(values[:span]) / span, sum(values[-span:]) / span


def end_span(n: int) -> int:
    """How many of n steps make the start or the end of a run: a tenth, at least 1 and at most 10."""
    return max(1, min(10, n // 10))


def accuracy_with_interval(p: float, n: int) -> str:
    """'0.296 +- 0.040': an accuracy over n problems and the half-width of its 95% (Wald) interval. At 0 or 1
    the Wald interval has no width, so the exact one-sided 95% bound is given, 1 - 0.05^(1/n) away (about 3/n,
    the rule of three): '1.000 (>= 0.970)'."""
    if not n:
        return f"{p:.3f}"
    if p in (0.0, 1.0):
        bound = 1 - 0.05 ** (1 / n)
        return f"{p:.3f} (>= {1 - bound:.3f})" if p == 1 else f"{p:.3f} (<= {bound:.3f})"
    return f"{p:.3f} +- {wald_half_width(p, n):.3f}"


def evaluation_line(row: dict, args, entropies: list[float]) -> str:
    """The line an evaluation leaves on screen above the progress bar: held-out accuracy and pass@k with their 95%
    intervals (for pass@k, a mean of per-problem values in [0, 1], the Wald half-width is an upper bound), and the
    token entropy as the mean of the rollouts since the previous line: one step's entropy is too noisy to show a
    trend in a few lines. At step 0 (the start model, no rollout yet) the line says what the intervals are."""
    step, k, sampled = row["step"], args.pass_k, min(args.pass_k_problems, args.n_test)   # pass@k's problems
    text = (f"step {step:>4}: held-out accuracy {accuracy_with_interval(row['eval/accuracy'], args.n_test)}, "
            f"pass@{k} {accuracy_with_interval(row[f'eval/pass@{k}'], sampled)}")
    if not entropies:
        return text + f" (the start model; +- : 95% intervals over {args.n_test} and {sampled} problems)"
    first = step - len(entropies) + 1
    steps = f"step {step}" if first == step else f"steps {first}-{step}"
    return text + f", entropy {sum(entropies) / len(entropies):.3f} (mean of {steps})"


def print_summary(summary: dict, rows: list[dict], args, wall: float) -> None:
    """The block that ends a run, to stay on screen: what changed (with the uncertainty that the number of
    held-out problems leaves), where the files are, and what to try next."""
    run_dir, k, n = summary["run_dir"], args.pass_k, args.n_test
    masks = [r["kl_mask/frac"] for r in rows if math.isfinite(r.get("kl_mask/frac", math.nan))]
    minutes, seconds = divmod(round(wall), 60)
    rows_out = [("held-out accuracy", f"{accuracy_with_interval(summary['start_accuracy'], n)} -> "
                 f"{accuracy_with_interval(summary['final_accuracy'], n)}  ({summary['gain_points']:+.1f} points; "
                 f"greedy; 95% intervals over {n} problems)"),
                (f"sampled (T={args.temperature:g})", f"{summary['start_sampled_accuracy']:.3f} -> "
                 f"{summary['final_sampled_accuracy']:.3f};  final pass@{k} {summary[f'final_pass@{k}']:.3f}  "
                 f"({k} samples of each of {min(args.pass_k_problems, n)} problems)")]
    measured = [r for r in rows if r["step"] > 0 and math.isfinite(r.get("entropy", math.nan))]
    if measured:       # means over the first and last tenth of the run: one step's entropy is noisy
        span = end_span(len(measured))
        first, last = summary["entropy_start"], summary["entropy_end"]
        rows_out.append(("token entropy", f"{first:.3f} -> {last:.3f} nats ({100 * (last / first - 1):+.0f}%; "
                         f"{'first and last step' if span == 1 else f'first and last {span} steps'}); "
                         "predicted vs measured change per step: "
                         + (f"r = {r:.2f}" if math.isfinite(r := summary["entropy_change_correlation"])
                            else f"too few steps for r (fewer than {MIN_STEPS_FOR_R} checked)")))
    if summary.get("decision_entropy_start") is not None:       # the hidden-type task
        first, last = summary["decision_entropy_start"], summary["decision_entropy_end"]
        rows_out.append(("decision token", f"entropy {first:.3f} -> {last:.3f} nats ({100 * (last / first - 1):+.0f}%)"
                         f"; strategies per group {summary['strategies_per_group_start']:.2f} -> "
                         f"{summary['strategies_per_group_end']:.2f}; valid format >= {summary['format_eval_min']:.3f} "
                         "(held-out samples)"))
        kinds = [kind for kind in HIDDEN_TYPES if f"final_pass@{k}/{kind}" in summary]   # types among the problems
        rows_out.append((f"pass@{k} by type", ", ".join(
            f"{kind} {summary[f'start_pass@{k}/{kind}']:.3f} -> {summary[f'final_pass@{k}/{kind}']:.3f}"
            for kind in kinds) + "  (start -> end; add is the majority's type)"))
    if masks:
        rows_out.append(("KL mask (TEPO)", f"{100 * sum(masks) / len(masks):.1f}% of tokens on average"))
    compare, notebook = "--compare grpo,tepo --seeds 3", "entropy_dynamics"
    if args.dataset is None and args.task == "hidden-type":
        compare = ("--task hidden-type --compare grpo:beta=0,clip_cov:clip_cov_ratio=0.01 --baseline grpo:beta=0 "
                   "--seeds 3")
        notebook = "entropy_collapse"
    rows_out += [("files", f"{run_dir}/ (metrics.jsonl, summary.json, checkpoint.pt, policy/)"),
                 ("next", f"python -m tepokit.plot {run_dir}   # the run's figures, as PNG files in its figures/"),
                 ("", f"python train_small.py {compare}   # two objectives, paired by seed"),
                 ("", f"jupyter lab notebooks/   # entropy_covariance.ipynb first (the derivation), then "
                      f"{notebook}.ipynb with RUN_DIR = \"{run_dir}\"")]
    took = f"{minutes} min {seconds} s" if minutes else f"{seconds} s"
    lines = [f"done: {args.objective}, seed {args.seed}, {rows[-1]['step']} RL steps in {took}"]
    lines += [f"  {label:<20} {text}" for label, text in rows_out]
    print("\n".join(lines), flush=True)
