"""--bench: the seconds of each phase of our RL step, against TRL's GRPOTrainer on the same work."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

import tepo
from tepokit.cli import objective_config
from tepokit.errors import fail
from tepokit.forward import rows_per_minibatch
from tepokit.memory import peak_memory_mb
from tepokit.model import pick_device, prepare_start_model
from tepokit.rundir import read_log, write_json
from tepokit.task import format_prompt, gold_answer, load_task, parse_strict

def benchmark(args, obj_overrides: dict, train) -> None:
    """Per-phase seconds, tokens/s and peak memory of our RL step, and of TRL's GRPOTrainer on the
    same model directory, batch, group size and lengths (two mini-batches per rollout for both). `train` is
    train_small.py's run (passed in: the package does not import the script)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        fail("--bench compares with TRL's GRPOTrainer, and trl is not installed; install it with: "
             "pip install -r requirements.txt")
    torch.set_num_threads(args.threads)
    checks = input_check_cost(args, obj_overrides)
    print(f"input checks of {args.objective} (tepo._prepare) on a {checks['batch']} mini-batch: "
          f"{1e3 * checks['checks_s']:.3f} ms of the objective's {1e3 * checks['objective_s']:.3f} ms "
          f"(forward and backward, {100 * checks['checks_s'] / checks['objective_s']:.1f}%)")
    out = args.out or os.path.join("runs", f"bench__{time.strftime('%Y%m%d-%H%M%S')}")
    n = args.bench_steps
    run = dataclasses.replace(args, bench=False, out=os.path.join(out, "ours"), steps=n + 1, eval_every=10**9,
                              save_every=10**9, pass_k=1, pass_k_problems=1, check_sampling_logprobs=False)
    train(run, obj_overrides)
    rows = read_log(os.path.join(out, "ours", "metrics.jsonl"))[2:]   # skip step 0 and step 1
    phases = ("timing/generate", "timing/reward", "timing/old_logprobs", "timing/update", "timing/entropy_check",
              "step_time", "perf/tokens_per_second")
    ours = {k: sum(r[k] for r in rows) / len(rows) for k in phases}
    ours["step_time"] -= sum(r["timing/eval"] for r in rows) / len(rows)
    ours["peak_memory_mb"] = max(r["perf/peak_memory_mb"] for r in rows)
    print(f"ours ({args.objective}): " + ", ".join(f"{k} {v:.3f}" for k, v in ours.items()))
    result = {"ours": ours, "setup": {"prompts": args.prompts_per_step, "group_size": args.group_size,
                                      "max_new_tokens": args.max_new_tokens, "mini_batches": args.mini_batches,
                                      "threads": args.threads, "steps_timed": n}, "input_checks": checks}
    result["trl"] = bench_trl(args, out, n)
    print("trl GRPOTrainer: " + ", ".join(f"{k} {v:.3f}" for k, v in result["trl"].items()))
    result["speedup"] = result["trl"]["step_time"] / ours["step_time"]
    print(f"our step is {result['speedup']:.2f}x the speed of TRL's")
    write_json(os.path.join(out, "bench.json"), result)


def bench_trl(args, out: str, n: int) -> dict:
    """TRL's GRPOTrainer, one rollout = `mini_batches` optimizer steps, timed per rollout."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    task = load_task(args)
    start_model = prepare_start_model(args, task, pick_device(args))
    golds = {format_prompt(q): gold_answer(a) for q, a in zip(task["train"]["question"], task["train"]["answer"])}

    def reward_fn(prompts, completions, **kw):
        return [float(parse_strict(c) == golds.get(p)) for p, c in zip(prompts, completions)]

    class Clock(TrainerCallback):
        times = []

        def on_step_end(self, *a, **k):
            self.times.append(time.time())

    rollout = args.prompts_per_step * args.group_size
    config = GRPOConfig(output_dir=os.path.join(out, "trl"), per_device_train_batch_size=rollout // args.mini_batches,
                        steps_per_generation=args.mini_batches, num_generations=args.group_size,
                        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_k=0, top_p=1.0,
                        learning_rate=args.lr, beta=0.0, loss_type="dapo", max_steps=(n + 1) * args.mini_batches,
                        gradient_checkpointing=args.gradient_checkpointing, use_cpu=pick_device(args).type == "cpu",
                        bf16=args.precision == "bf16", report_to="none", save_strategy="no",   # as tepo's run
                        logging_steps=1, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    prompts = datasets.Dataset.from_dict({"prompt": [format_prompt(q) for q in list(task["train"]["question"])]})
    clock = Clock()
    trainer = GRPOTrainer(model=start_model, reward_funcs=reward_fn, args=config, train_dataset=prompts,
                          callbacks=[clock])
    t0 = time.time()
    trainer.train()
    ends = [t0] + clock.times
    per_rollout = [ends[i + args.mini_batches] - ends[i]          # the first rollout (untimed) is skipped
                   for i in range(args.mini_batches, len(ends) - args.mini_batches, args.mini_batches)]
    step = sum(per_rollout) / max(1, len(per_rollout))
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_time": step, "perf/tokens_per_second": rollout * lengths[-1] / step,
            "peak_memory_mb (process-wide, includes ours)": peak_memory_mb(torch.device("cpu"))}


def input_check_cost(args, obj_overrides: dict, repeats: int = 30) -> dict:
    """Median seconds of tepo's input checks (_prepare: switches, shapes, 0/1 mask, NaN / inf where
    mask is 1) and of the whole objective call with its backward, on one mini-batch of the bench's
    shape ([rows, max_new_tokens], float32, rows of random lengths) filled with random log-probs."""
    rows = rows_per_minibatch(args)
    T = args.max_new_tokens
    g = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(rows, T, generator=g) * 3                           # [rows, T]
    logp = (old_logp + 0.1 * torch.randn(rows, T, generator=g)).requires_grad_(True)
    mask = (torch.arange(T) < torch.randint(T // 5, T + 1, (rows, 1), generator=g)).float()   # [rows, T]
    advantages = torch.randn(rows, generator=g)                                # [rows]
    optional = dict(ref_logp=old_logp.clone(), entropy=torch.rand(rows, T, generator=g),
                    old_entropy=torch.rand(rows, T, generator=g))             # each [rows, T]
    cfg = objective_config(args, obj_overrides)
    objective = tepo.OBJECTIVES[args.objective]

    def checks():
        tepo._prepare(logp, old_logp, advantages, mask, cfg, **optional)

    def objective_with_backward():
        objective(logp, old_logp, advantages, mask, cfg, **optional)[0].backward()

    def median_seconds(fn):
        fn()                                                                # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return {"batch": f"[{rows}, {T}]", "checks_s": median_seconds(checks),
            "objective_s": median_seconds(objective_with_backward)}
