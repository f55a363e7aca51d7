"""tepokit: what a reader of train_small.py can skip, one concern per module.

  cli            the command line: flags, valid values, --regime and --demo, the rules of --resume
  helptext       what --help shows: the examples and common flags first, each flag's text, the paper values
  errors         one-line answers to user mistakes
  hub            the Hugging Face hub: offline in seconds when it cannot be reached
  task           the built-in arithmetic task, dataset loading, answer parsing (the reward)
  model          the built-in tokenizer and model, its warm-up (committed or cached), loading a real model
  forward        micro-batch sizes, completion logits, memory-bounded log-probs and entropy
  step_settings  what the RL step's helpers read, resolved once from the run's flags and model
  entropy_check  predicted against measured entropy change after each RL step
  kl_mask_log    details.jsonl: where TEPO's KL mask falls
  memory         the memory plan (--dry-run) and peak memory
  rundir         the run directory: lock, config, logs, checkpoints, resume checks, summary.json
  stop           Ctrl-C, SIGTERM and SIGHUP: finish the step, checkpoint, exit
  stats          pass@k, Pearson's r, t intervals, a mini-batch's metrics from its micro-batches
  compare        --compare: objectives x seeds, paired by seed
  bench          --bench: our RL step against TRL's GRPOTrainer
  tepo_trl       TepoGRPOTrainer: any tepo objective inside TRL's GRPOTrainer (--engine trl)
  plot           python -m tepokit.tools.plot RUN_DIR: a run's figures; run reading and plotting shared with the notebooks

Imports form a tree: tepo.py imports only torch; these modules import tepo and each other; train_small.py
imports both, and nothing imports train_small.py. transformers, datasets and TRL are imported inside the
functions that use them, so that --help, --dry-run and a refused flag answer without loading them.
"""

import os

# The CPU is shared: busy-waiting OpenMP threads slow a contended machine down several-fold (docs/results.md).
# Set here, before torch starts its thread pool: train_small.py imports tepokit first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
