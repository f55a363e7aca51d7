"""The checks before --resume: a run directory's config.json, checkpoint.pt (or TRL's checkpoint-N/
directories) and logs agree with each other and with the loaded model, tokenizer and data. They only read:
nothing is changed until they pass, and a run that cannot be resumed is refused in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile

import torch

import tepo
from tepokit.plumbing.errors import fail, first_line
from tepokit.plumbing.rundir import DamagedLog, read_log

CANNOT_RESUME = "the run cannot be resumed (nothing was changed)"


def identity_differences(saved: dict, found: dict) -> list[str]:
    """The parts of a run's identity (run_identity) in which `found` differs from `saved`."""
    return [key for key, value in saved.items() if found.get(key) != value]


# Settings a config.json may lack (it was written before they existed), with the value that does what such a
# run did, so that --resume continues it with the same arithmetic: generate sampled, the old log-probs were
# recomputed, and the forward read each prompt once (--fast).
DEFAULTS_OF_OLDER_CONFIGS = {"sampler": "generate", "recompute_old_logprobs": True, "fast": True, "optimizer": "adam",
                             # before chat templates, rewards by name, LoRA and completions.jsonl: the bare question
                             "chat_template": "off", "system_prompt": None, "mask_truncated": False, "lora_rank": 0,
                             "lora_alpha": None, "lora_target_modules": "auto", "lora_base_bf16": False,
                             "log_completions_every": 0}


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
    # before --decode-precision a fp32 run of our loop decoded in fp32 on every device (auto is TF32 on a GPU now);
    # not in DEFAULTS_OF_OLDER_CONFIGS, which --compare also reads: it depends on the run's other settings
    saved["args"].setdefault("decode_precision", "fp32" if saved["args"].get("precision") == "fp32"
                             and saved["args"].get("engine") == "tepo" else "auto")
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
