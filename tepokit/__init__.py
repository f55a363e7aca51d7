"""tepokit: what a reader of train_small.py can skip, in folders named for what they hold. Imports only go down
this list (a folder imports the ones below it, never one above), and nothing imports train_small.py.

  tools/        what a user runs beside training: memory.py (the memory plan, --dry-run,
                --check-memory-on-device), bench.py (--bench: our step against TRL's GRPOTrainer), compare.py
                (--compare: objectives x seeds, paired by seed), tepo_trl.py (--engine trl), plot.py
                (python -m tepokit.tools.plot RUN_DIR: a run's figures, shared with the notebooks), merge_lora.py
                (python -m tepokit.tools.merge_lora RUN_DIR/policy OUT: a LoRA run's adapters folded into its base),
                collapse_numbers.py and band_numbers.py (docs/collapse.md's numbers from the committed logs),
                tour.py (python -m tepokit.tools.tour: every objective of tepo.py on one batch), gpu_check.py
                (python -m tepokit.tools.gpu_check: generation, memory and the bench measured on a GPU)
  cli/          the command line: flags.py (one flag per field, --regime, --demo), validation.py (valid values),
                helptext.py (what --help shows), resume.py (the rules of --resume)
  diagnostics/  every measurement, run after the RL step from its record: after_step.py (the step's measurements,
                and the taps they ask of the update), entropy_check.py (predicted against measured entropy
                change), mechanisms.py (what each mechanism did at a real optimizer step), forking_tokens.py
                (the decision tokens of a rollout), band.py (which completions the clip takes out),
                kl_mask_details.py (details.jsonl: where TEPO's KL mask falls), completions.py (completions.jsonl,
                a few completions to read, and the warnings of a run that cannot learn), stats.py (pass@k,
                intervals, exact tests, Holm's correction), summary.py (the progress line and summary.json)
  setup/        the task and the model: task.py (the built-in tasks, data sets, their checks), model.py (the
                character tokenizer, the tiny model and its warm-up, loading a real model, the device), lora.py
                (--lora-rank: peft's adapters beside the frozen base, which is also the reference model), shapes.py
                (real models' shapes with random weights, for the bench and gpu_check)
  core/         what the RL step calls, and nothing else: forward.py (completion logits, memory-bounded log-probs
                and entropy), reward.py (the prompt, with an instruct model's chat template or without, and the
                rewards of --reward), metrics.py (a mini-batch's metrics from its micro-batches'), clock.py (each
                phase's seconds), taps.py (the update's one observer, through which the measurements look inside
                it); the fast twins of the plain path, each tested equal to it:
                sampling.py (which sampler a rollout uses, in which --decode-precision), shared_prefix.py (the GPT-2
                sampler that reads each prompt once per group, and the sampling loop), generate.py (every other
                model's), cuda_graph.py (a static KV cache replayed as a CUDA graph); step_settings.py (what the step
                reads, resolved once)
  plumbing/     the run directory and the process: rundir.py (lock, config, logs, checkpoints), signals.py (Ctrl-C,
                SIGTERM, SIGHUP: finish the step, checkpoint, exit), non_finite.py (a non-finite loss, gradient
                or weight ends the run), report.py (--report-to), peak_memory.py, hub.py (the Hugging Face hub,
                offline in seconds), errors.py (one-line answers to user mistakes)

tepo.py imports only torch. transformers, datasets and TRL are imported inside the functions that use them, so
that --help, --dry-run and a refused flag answer without loading them.
"""

import os

# The CPU is shared: busy-waiting OpenMP threads slow a contended machine down several-fold (docs/results.md).
# Set here, before torch starts its thread pool: train_small.py imports tepokit first.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
