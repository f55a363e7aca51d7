"""--bench: the seconds of each phase of our RL step, against TRL's GRPOTrainer on the same work."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import torch

import tepo
from tepokit.cli import flag, objective_config
from tepokit.errors import fail
from tepokit.forward import rows_per_forward, rows_per_minibatch
from tepokit.memory import peak_memory_mb
from tepokit.model import pick_device, prepare_start_model
from tepokit.rundir import read_log, write_json
from tepokit.task import format_prompt, gold_answer, load_task, parse_strict

# --bench's FLOP-counting run sets this to an active torch.utils.flop_counter.FlopCounterMode.
FLOP_COUNTER = None


class PhaseClock:
    """Seconds of each phase of an RL step, and its FLOPs when --bench counts them (FLOP_COUNTER).
    clock.lap(name) ends the phase `name`; clock.row() gives timing/<name> (flops/<name>) and step_time."""

    def __init__(self):
        self.start = self.last = time.time()
        self.flops = self.flops_total()
        self.seconds, self.counted = {}, {}

    @staticmethod
    def flops_total() -> int:
        return FLOP_COUNTER.get_total_flops() if FLOP_COUNTER is not None else 0

    def lap(self, name: str) -> None:
        now, flops = time.time(), self.flops_total()
        self.seconds[name], self.counted[name] = now - self.last, flops - self.flops
        self.last, self.flops = now, flops

    def total(self) -> float:
        return self.last - self.start

    def row(self) -> dict:
        flops = {f"flops/{k}": v for k, v in self.counted.items()} if FLOP_COUNTER is not None else {}
        return {**{f"timing/{k}": v for k, v in self.seconds.items()}, "step_time": self.total(), **flops}


PHASES = ("generate", "reward", "old_logprobs", "update", "entropy_check")


def benchmark(args, obj_overrides: dict, train) -> None:
    """Per-phase seconds, FLOP/s against the machine's matmul rate, tokens/s and peak memory of our RL
    step; TRL's GRPOTrainer on the same model directory, batch, group size and lengths (two mini-batches
    per rollout for both); the peak memory at twice the rollout. `train` is train_small.py's run
    (passed in: the package does not import the script)."""
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
    ours = timed_steps(args, obj_overrides, train, os.path.join(out, "ours"))
    flops = counted_flops(args, obj_overrides, train, os.path.join(out, "ours_flops"))
    rate = matmul_rate(args.threads, torch.bfloat16 if args.precision == "bf16" else torch.float32)
    print_phases(ours, flops, rate)
    result = {"ours": ours, "flops_per_step": flops, "matmul_flops_per_second": rate, "input_checks": checks,
              "setup": {"prompts": args.prompts_per_step, "group_size": args.group_size,
                        "max_new_tokens": args.max_new_tokens, "mini_batches": args.mini_batches,
                        "threads": args.threads, "steps_timed": args.bench_steps}}
    result["trl"] = bench_trl(args, out, args.bench_steps)
    print("trl GRPOTrainer: " + ", ".join(f"{k} {v:.3f}" for k, v in result["trl"].items()))
    result["speedup"] = result["trl"]["step_time"] / ours["step_time"]
    print(f"our step is {result['speedup']:.2f}x the speed of TRL's")
    result["rollout_memory"] = rollout_memory(args, obj_overrides, out)
    write_json(os.path.join(out, "bench.json"), result)


def bench_args(args, out: str):
    """The bench's runs: --bench-steps timed steps after one untimed step, no evaluation beyond a token
    one at the start, no checkpoints."""
    return dataclasses.replace(args, bench=False, out=out, steps=args.bench_steps + 1, eval_every=10**9, n_test=16,
                               save_every=10**9, pass_k=1, pass_k_problems=1, check_sampling_logprobs=False)


def timed_steps(args, obj_overrides: dict, train, out: str) -> dict:
    """Mean seconds of each phase (and of the step, evaluation excluded), tokens/s and peak memory over
    the timed steps."""
    train(bench_args(args, out), obj_overrides)
    rows = read_log(os.path.join(out, "metrics.jsonl"))[2:]   # skip step 0 and step 1
    keys = [f"timing/{p}" for p in PHASES] + ["step_time", "perf/tokens_per_second"]
    ours = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    ours["step_time"] -= sum(r["timing/eval"] for r in rows) / len(rows)
    ours["peak_memory_mb"] = max(r["perf/peak_memory_mb"] for r in rows)
    print(f"ours ({args.objective}): " + ", ".join(f"{k} {v:.3f}" for k, v in ours.items()))
    return ours


def counted_flops(args, obj_overrides: dict, train, out: str) -> dict:
    """Mean floating-point operations of each phase over the timed steps, counted by replaying the same
    run (same seed: the same rollouts) under torch's FlopCounterMode, which counts matrix products and
    attention (elementwise work is not counted: it is not what a matmul rate measures)."""
    global FLOP_COUNTER
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten       # the CPU's attention kernels are missing from torch's formulas: add them
    cpu_attention = {aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as FLOP_COUNTER:
        try:
            train(bench_args(args, out), obj_overrides)
        finally:
            FLOP_COUNTER = None
    rows = read_log(os.path.join(out, "metrics.jsonl"))[2:]
    return {p: sum(r[f"flops/{p}"] for r in rows) / len(rows) for p in PHASES}


def attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """softmax(q k^T) v for shapes [b, h, s_q, d] and [b, h, s_k, d]: two products of 2 s_q s_k d each."""
    b, h, s_q, d = query
    return 4 * b * h * s_q * key[2] * d


def attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The backward's four products (gradients of v, of the weights, of q and of k), as large as the forward's."""
    return 2 * attention_flops(query, key, value)


def matmul_rate(threads: int, dtype, n: int = 1024, repeats: int = 10) -> float:
    """The machine's dense matrix-product rate (FLOP/s) on `threads` threads in `dtype`: the median of
    `repeats` products of two n x n matrices (2 n^3 operations each)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b                                                                   # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def print_phases(ours: dict, flops: dict, rate: float) -> None:
    print(f"where the step goes (the machine's dense matmul rate: {rate / 1e9:.1f} GFLOP/s):")
    print(f"  {'phase':<15}{'seconds':>9}{'share':>7}{'GFLOP':>9}{'GFLOP/s':>9}{'of the rate':>13}")
    for p in PHASES:
        seconds = ours[f"timing/{p}"]
        achieved = flops[p] / seconds if seconds > 0 else 0.0
        print(f"  {p:<15}{seconds:>9.3f}{seconds / ours['step_time']:>7.0%}{flops[p] / 1e9:>9.2f}"
              f"{achieved / 1e9:>9.2f}{achieved / rate:>13.1%}")


# Settings of the bench's own run that the memory runs do not take over.
NOT_PASSED_ON = ("bench", "bench_steps", "out", "compare", "seeds", "resume", "overwrite", "steps", "eval_every")
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train_small.py")


def rollout_memory(args, obj_overrides: dict, out: str) -> dict:
    """Peak memory of one RL step at the run's rollout and at twice as many prompts, with the micro-batch
    fixed at the run's rows per forward: each in a process of its own (the peak resident memory of a
    process cannot be reset cleanly), counted above the process's memory before the model is loaded."""
    micro = rows_per_forward(args)
    peaks = {}
    for prompts in (args.prompts_per_step, 2 * args.prompts_per_step):
        run_dir = os.path.join(out, f"memory_{prompts}_prompts")
        settings = {**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                       if getattr(args, f.name) != f.default and f.name not in NOT_PASSED_ON},
                    **obj_overrides, "prompts_per_step": prompts, "micro_batch_size": micro, "steps": 1,
                    "eval_every": 10**6, "n_test": 8, "pass_k": 1, "pass_k_problems": 1, "out": run_dir}
        argv = [sys.executable, SCRIPT] + [a for k, v in settings.items() for a in flag_and_value(k, v)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"--bench: the memory run with {prompts} prompts failed: {done.stderr.strip().splitlines()[-1]}")
        rows = read_log(os.path.join(run_dir, "metrics.jsonl"))
        peaks[prompts] = rows[1]["perf/peak_memory_mb"] - rows[0]["memory/process_before_model_mb"]
    small, large = peaks[args.prompts_per_step], peaks[2 * args.prompts_per_step]
    print(f"peak memory above the process's before the model, micro-batch {micro} rows: {small:.0f} MiB at "
          f"{args.prompts_per_step} prompts, {large:.0f} MiB at {2 * args.prompts_per_step} ({large / small:.2f}x)")
    return {"micro_batch_size": micro, "peak_mb_above_start": peaks, "ratio": large / small}


def flag_and_value(name: str, value) -> list[str]:
    """The command-line form of one setting: --name value, or --name / --no-name for a switch."""
    if isinstance(value, bool):
        return [flag(name) if value else "--no-" + flag(name)[2:]]
    return [flag(name), str(value)]


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
