"""Fold a LoRA run's adapters into its base model: one plain transformers model that any tool loads without peft.

    python -m tepokit.tools.merge_lora RUN_DIR/policy OUT_DIR

RUN_DIR/policy is what a --lora-rank run saves (tepokit/setup/lora.py): adapter_config.json, whose
base_model_name_or_path names the base (the start model: --model, or the built-in warm-up's directory), the
adapters (adapter_model.safetensors) and the tokenizer. Each adapted weight becomes W + (alpha / r) B A
(peft's merge_and_unload), in fp32, whatever dtype the run kept its base in. OUT_DIR gets the merged model and
the tokenizer, written whole or not at all (a temporary directory, then renamed); a bad input is one line on
stderr, and nothing is written."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

from tepokit.plumbing.errors import fail, first_line, os_error_line
from tepokit.plumbing.hub import without_transformers_bars
from tepokit.plumbing.rundir import save_pretrained_atomically
from tepokit.setup.lora import INSTALL_PEFT, peft_installed

PROGRAM = "python -m tepokit.tools.merge_lora"


def refuse(message: str) -> None:
    """A user mistake, in one line that names this command (tepokit.plumbing.errors.fail)."""
    fail(message, program=PROGRAM)


def read_adapter_config(policy_dir: str) -> dict:
    """adapter_config.json of a LoRA run's policy, checked; one line if it is not one."""
    path = os.path.join(policy_dir, "adapter_config.json")
    if not os.path.isdir(policy_dir):
        refuse(f"{policy_dir} is not a directory; give a LoRA run's policy directory (RUN_DIR/policy)")
    if not os.path.isfile(path):
        refuse(f"{policy_dir} has no adapter_config.json: it is not the policy of a --lora-rank run "
             "(a run without LoRA saves a whole model, which needs no merging)")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        refuse(f"{path} is not readable JSON ({e})")
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        refuse(f"{path} is not a LoRA adapter's config (peft_type LORA)")
    return config


def merge(policy_dir: str, out_dir: str, base: str | None = None) -> str:
    """The merged model of `policy_dir`'s adapters and their base (or `base`), saved with the tokenizer in
    `out_dir`, which must not exist or be empty. Returns out_dir."""
    if not peft_installed():
        refuse(f"merging needs peft, which is not installed; {INSTALL_PEFT}")
    config = read_adapter_config(policy_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        refuse(f"{out_dir} exists and is not an empty directory; choose a new OUT_DIR")
    base = base or config.get("base_model_name_or_path")
    if not base:
        refuse(f"{policy_dir}/adapter_config.json names no base model; give it with --base")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        with without_transformers_bars(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(policy_dir)
            model = PeftModel.from_pretrained(model, policy_dir).merge_and_unload()
    except Exception as e:  # noqa: BLE001 -- any loading failure is a one-line answer
        refuse(f"cannot load the base model {base!r} with the adapters of {policy_dir} "
             f"({type(e).__name__}: {first_line(e)}); give the base with --base")
    try:
        save_pretrained_atomically(model, tokenizer, out_dir)
    except OSError as e:
        refuse(os_error_line(e))
    return out_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tepokit.tools.merge_lora", description=__doc__.split("\n")[0])
    parser.add_argument("policy_dir", help="a --lora-rank run's policy directory (RUN_DIR/policy)")
    parser.add_argument("out_dir", help="where the merged model goes (a new or empty directory)")
    parser.add_argument("--base", help="the base model (default: adapter_config.json's base_model_name_or_path)")
    args = parser.parse_args(argv)
    out = merge(args.policy_dir, args.out_dir, args.base)
    print(f"merged: {out} (a plain model: --model {out}, or AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
