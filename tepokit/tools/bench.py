"""--bench: the seconds of each phase of our RL step, against TRL's GRPOTrainer on the same work."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
import warnings
from statistics import median

import torch

import tepo
from tepokit.cli.flags import command_line, flag_and_value, objective_config
from tepokit.plumbing.errors import fail, quiet
from tepokit.core.step_settings import rows_per_forward, rows_per_minibatch
from tepokit.core.clock import PhaseClock, wait_for_the_gpu
from tepokit.core.sampling import decode_precision, decoding
from tepokit.setup.model import pick_device, prepare_start_model
from tepokit.setup.shapes import save_random_model
from tepokit.plumbing.rundir import read_log, write_json
from tepokit.plumbing.signals import Stopped
from tepokit.setup.task import load_task
from tepokit.core.reward import format_prompt, gold_answer, parse_strict


PHASES = ("generate", "reward", "old_logprobs", "update")    # what the bench times (its entropy check is off)


def benchmark(args, obj_overrides: dict, train) -> None:
    """Our RL step against TRL's GRPOTrainer on the same work, --bench-repeats times in alternation (ours,
    ours recomputing the old log-probs, TRL, ours, ...): the median ratio and its spread. Then where our
    step goes (seconds, FLOP/s against the machine's matmul rate) and, on the built-in shape, the peak
    memory at twice the rollout. `train` is train_small.py's run (passed in: the package does not import
    the script).

    The same work on both sides: the same start model, prompts, group size, lengths, temperature,
    mini-batches, micro-batches, epochs, learning rate, precision and checkpointing (bench_trl_config), and
    every row trained: DAPO's dynamic sampling, which drops the groups whose rewards are all equal, is
    turned off on our side (TRL's GRPOTrainer has no such filter). A reference model on both sides when
    the objective needs one (TRL's beta). What still differs is printed with the result."""
    try:
        import trl  # noqa: F401
    except ImportError:
        fail("--bench compares with TRL's GRPOTrainer, and trl is not installed; install it with: "
             "pip install -r requirements.txt")
    torch.set_num_threads(args.threads)
    again = command_line(args, obj_overrides, out=None)     # a bench stopped part-way is run again, afresh
    out = args.out or os.path.join("runs", f"bench__{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        measure(args, obj_overrides, train, out)
    except Stopped as stop:    # the whole bench stops: its ratios pair runs made back to back, so it starts over
        stop.message = f"--bench stopped; what it measured so far is in {out}; run it again with: {again}"
        raise


def measure(args, obj_overrides: dict, train, out: str) -> None:
    """The bench's runs and its result, into `out` (benchmark says what they are)."""
    if args.bench_shape == "gpt2-small":
        # GPT-2 small's shape, random weights (tepokit/setup/shapes.py): every row runs to --max-new-tokens
        args = dataclasses.replace(args, model=save_random_model("gpt2-small", load_task(args), args.seed,
                                                                 os.path.join(out, "gpt2_small")))
    same_work = {**obj_overrides, "dynamic_sampling": False}
    cfg = objective_config(args, same_work)
    reference = "; a reference model on both" if tepo.needs_ref(args.objective, cfg) else ""
    print(f"--bench: {args.objective} against TRL's GRPOTrainer, {args.bench_repeats} alternating repeats of "
          f"{args.bench_steps} timed step(s) after an untimed one; {args.prompts_per_step} prompts x "
          f"{args.group_size} samples, up to {args.max_new_tokens} new tokens, {args.threads} thread(s); "
          f"every row trained on both sides (dynamic sampling off){reference}")
    checks = input_check_cost(args, same_work)
    print(f"input checks of {args.objective} (tepo._prepare) on a {checks['batch']} mini-batch: "
          f"{1e3 * checks['checks_s']:.3f} ms of the objective's {1e3 * checks['objective_s']:.3f} ms "
          f"(forward and backward, {100 * checks['checks_s'] / checks['objective_s']:.1f}%)")
    device = pick_device(args)
    decode = decode_precision(args.decode_precision, args.precision, device.type)
    sides = {"ours": [], "ours_recomputed": [], "trl": []}
    sampler_side, recomputing_side = old_logprob_sides(args)
    for r in range(args.bench_repeats):
        sides["ours"].append(timed_steps(sampler_side, same_work, train, os.path.join(out, f"ours_{r + 1}")))
        sides["ours_recomputed"].append(timed_steps(recomputing_side, same_work, train,
                                                    os.path.join(out, f"ours_recomputed_{r + 1}")))
        sides["trl"].append(bench_trl(args, cfg, os.path.join(out, f"trl_{r + 1}"), decode))
        print(f"  repeat {r + 1}/{args.bench_repeats}: ours {sides['ours'][-1]['step_time']:.3f} s, ours recomputing "
              f"the old log-probs {sides['ours_recomputed'][-1]['step_time']:.3f} s, TRL "
              f"{sides['trl'][-1]['step_time']:.3f} s per step", flush=True)
    result = {"setup": {"shape": args.bench_shape, "prompts": args.prompts_per_step, "group_size": args.group_size,
                        "max_new_tokens": args.max_new_tokens, "mini_batches": args.mini_batches,
                        "epochs": args.epochs, "micro_batch_size": args.micro_batch_size,
                        "precision": args.precision, "decode_precision": decode, "threads": args.threads,
                        "steps_timed": args.bench_steps,
                        "repeats": args.bench_repeats, "trl_config": bench_trl_config(args, cfg, "trl")},
              "input_checks": checks, **sides,
              "ratio": ratio_summary([t["step_time"] for t in sides["trl"]], [o["step_time"] for o in sides["ours"]]),
              "ratio_recomputed": ratio_summary([t["step_time"] for t in sides["trl"]],
                                                [o["step_time"] for o in sides["ours_recomputed"]])}
    print_result(result, decode)
    flops = counted_flops(args, same_work, train, os.path.join(out, "ours_flops"))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    rate = matmul_rate(args.threads, dtype, device)
    median_ours = {k: median([o[k] for o in sides["ours"]]) for k in sides["ours"][0]}
    print_phases(median_ours, flops, rate, f"{device_name(device)}, {str(dtype)[6:]}")
    result.update(flops_per_step=flops, matmul_flops_per_second=rate, device=device_name(device),
                  matmul_dtype=str(dtype)[6:])
    if args.bench_shape == "builtin":
        result["rollout_memory"] = rollout_memory(args, same_work, out)
    else:
        shutil.rmtree(args.model)         # the random model is made again by the same command
    write_json(os.path.join(out, "bench.json"), result)
    print(f"written: {os.path.join(out, 'bench.json')}")


def old_logprob_sides(args) -> tuple:
    """Our two sides' settings: the sampler's old log-probs, unless --recompute-old-logprobs was given (unset, TF32
    and bf16 decoding would recompute them too, and both sides would be the same run), and recomputing them."""
    asked = args.recompute_old_logprobs
    sampler = args if asked is not None else dataclasses.replace(args, recompute_old_logprobs=False)
    return sampler, dataclasses.replace(args, recompute_old_logprobs=True)


def ratio_summary(trl_seconds: list, our_seconds: list) -> dict:
    """TRL's seconds per step over ours, per repeat (repeat i of each side was run back to back), their
    median and their range."""
    ratios = [t / o for t, o in zip(trl_seconds, our_seconds)]
    return {"per_repeat": ratios, "median": median(ratios), "min": min(ratios), "max": max(ratios)}


def print_result(result: dict, decode: str) -> None:
    ratio, recomputed = result["ratio"], result["ratio_recomputed"]
    ours = median([o["step_time"] for o in result["ours"]])
    again = median([o["step_time"] for o in result["ours_recomputed"]])
    print(f"our step is {ratio['median']:.2f}x the speed of TRL's (median of {len(ratio['per_repeat'])} repeats; "
          f"range {ratio['min']:.2f}x to {ratio['max']:.2f}x)")
    generate = {side: median([r["timing/generate"] for r in result[side]]) for side in ("ours", "trl")}
    trl = median([t["step_time"] for t in result["trl"]])
    print(f"generation: ours {generate['ours']:.3f} s, TRL's {generate['trl']:.3f} s "
          f"({generate['trl'] / generate['ours']:.2f}x); the rest of the step: ours {ours - generate['ours']:.3f} s, "
          f"TRL's {trl - generate['trl']:.3f} s ({(trl - generate['trl']) / (ours - generate['ours']):.2f}x)")
    print(f"recomputing the old log-probs (--recompute-old-logprobs, the default in bf16 and TF32) costs "
          f"{again - ours:.3f} s a step ({100 * (again / ours - 1):+.0f}%): {recomputed['median']:.2f}x TRL's (range "
          f"{recomputed['min']:.2f}x to {recomputed['max']:.2f}x), the passes TRL makes")
    print("what still differs: ours takes the old log-probs from the sampler unless --recompute-old-logprobs is "
          "given (TRL makes a forward pass for them, as ours does when recomputing), reads each "
          "prompt once per group, samples with its own loop and runs GPT-2's tanh gelu as one kernel; TRL samples "
          "with generate and computes its GRPO loss; both sides' completion lengths follow their own samples. Both "
          f"sides decode in {decode} (--decode-precision)")


def bench_args(args, out: str):
    """The bench's runs: --bench-steps timed steps after one untimed step, no evaluation beyond a token
    one at the start (the held-out set keeps its size: it is part of the task, and so of the start model),
    no checkpoints, no entropy check (a measurement TRL does not make), no tracker."""
    return dataclasses.replace(args, bench=False, out=out, steps=args.bench_steps + 1, eval_every=10**9,
                               save_every=10**9, pass_k=1, pass_k_problems=1, check_sampling_logprobs=False,
                               entropy_check_every=10**9, effect_check_every=0, report_to="none")


def timed_steps(args, obj_overrides: dict, train, out: str) -> dict:
    """Mean seconds of each phase (and of the step, evaluation excluded), tokens/s and peak memory over
    the timed steps. The run's console lines go to <out>.log, not to the bench's output."""
    with quiet(out + ".log"):
        train(bench_args(args, out), obj_overrides)
    rows = read_log(os.path.join(out, "metrics.jsonl"))[2:]   # skip step 0 and step 1
    keys = [f"timing/{p}" for p in PHASES] + ["step_time", "perf/tokens_per_second"]
    ours = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    ours["step_time"] -= sum(r["timing/eval"] for r in rows) / len(rows)
    ours["peak_memory_mb"] = max(r["perf/peak_memory_mb"] for r in rows)
    return ours


def counted_flops(args, obj_overrides: dict, train, out: str) -> dict:
    """Mean floating-point operations of each phase over the timed steps, counted by replaying the same
    run (same seed: the same rollouts) under torch's FlopCounterMode, which counts matrix products and
    attention (elementwise work is not counted: it is not what a matmul rate measures). The replay runs
    without CUDA graphs: a replayed graph's kernels bypass the counter, which would then see only the prefill."""
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten       # the CPU's attention kernels are missing from torch's formulas: add them
    cpu_attention = {aten._scaled_dot_product_flash_attention_for_cpu: attention_flops,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter, quiet(out + ".log"):
        train(dataclasses.replace(bench_args(args, out), cuda_graphs="off"), obj_overrides,
              clock=lambda: PhaseClock(flop_counter=counter))
    rows = read_log(os.path.join(out, "metrics.jsonl"))[2:]
    return {p: sum(r[f"flops/{p}"] for r in rows) / len(rows) for p in PHASES}


def attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """softmax(q k^T) v for shapes [b, h, s_q, d] and [b, h, s_k, d]: two products of 2 s_q s_k d each."""
    b, h, s_q, d = query
    return 4 * b * h * s_q * key[2] * d


def attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """The backward's four products (gradients of v, of the weights, of q and of k), as large as the forward's."""
    return 2 * attention_flops(query, key, value)


def matmul_rate(threads: int, dtype, device=torch.device("cpu"), n: int | None = None, repeats: int = 10) -> float:
    """The device's dense matrix-product rate (FLOP/s) in `dtype` (on `threads` threads on the CPU): the
    median of `repeats` products of two n x n matrices (2 n^3 operations each; n 1024 on the CPU, 8192 on a
    GPU, which smaller products leave idle), each timed to the end of its kernel."""
    torch.set_num_threads(threads)
    n = n or (8192 if device.type == "cuda" else 1024)
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b                                                                   # warm-up
    times = []
    for _ in range(repeats):
        wait_for_the_gpu()
        t0 = time.perf_counter()
        a @ b
        wait_for_the_gpu()
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / sorted(times)[len(times) // 2]


def device_name(device) -> str:
    """The GPU's name (torch.cuda.get_device_name), or the CPU's and the threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)"


def print_phases(ours: dict, flops: dict, rate: float, device: str) -> None:
    """Seconds, share of the step, FLOPs and FLOP/s of each phase, and that rate against the device's matmul
    rate in the run's dtype (`device` names both)."""
    print(f"where the step goes (dense matmul rate of {device}: {rate / 1e9:.1f} GFLOP/s):")
    print(f"  {'phase':<15}{'seconds':>9}{'share':>7}{'GFLOP':>9}{'GFLOP/s':>9}{'of the rate':>13}")
    for p in PHASES:
        seconds = ours[f"timing/{p}"]
        achieved = flops[p] / seconds if seconds > 0 else 0.0
        print(f"  {p:<15}{seconds:>9.3f}{seconds / ours['step_time']:>7.0%}{flops[p] / 1e9:>9.2f}"
              f"{achieved / 1e9:>9.2f}{achieved / rate:>13.1%}")


# Settings of the bench's own run that the memory runs do not take over.
NOT_PASSED_ON = ("bench", "bench_steps", "bench_repeats", "bench_shape", "out", "compare", "seeds", "resume",
                 "overwrite", "steps", "eval_every", "report_to")
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train_small.py")


def rollout_memory(args, obj_overrides: dict, out: str) -> dict:
    """Peak memory of one RL step at the run's rollout and at twice as many prompts, with the micro-batch
    fixed at the run's rows per forward: each in a process of its own (the peak resident memory of a
    process cannot be reset cleanly), counted above the process's memory before the model is loaded (on a
    GPU: the memory CUDA allocated)."""
    micro = rows_per_forward(args.micro_batch_size, args.prompts_per_step, args.mini_batches, args.group_size)
    peaks = {}
    for prompts in (args.prompts_per_step, 2 * args.prompts_per_step):
        run_dir = os.path.join(out, f"memory_{prompts}_prompts")
        settings = {**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                       if getattr(args, f.name) != f.default and f.name not in NOT_PASSED_ON},
                    **obj_overrides, "prompts_per_step": prompts, "micro_batch_size": micro, "steps": 1,
                    "eval_every": 10**6, "pass_k": 1, "pass_k_problems": 1, "out": run_dir}
        argv = [sys.executable, SCRIPT] + [a for k, v in settings.items() for a in flag_and_value(k, v)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"--bench: the memory run with {prompts} prompts failed: {done.stderr.strip().splitlines()[-1]}")
        rows = read_log(os.path.join(run_dir, "metrics.jsonl"))
        # on a GPU the peak is CUDA's count from the model's loading on; on the CPU the process's, less its start
        on_cpu = pick_device(args).type == "cpu"
        peaks[prompts] = rows[1]["perf/peak_memory_mb"] - on_cpu * rows[0]["memory/process_before_model_mb"]
    small, large = peaks[args.prompts_per_step], peaks[2 * args.prompts_per_step]
    print(f"peak memory above the process's before the model, micro-batch {micro} rows: {small:.0f} MiB at "
          f"{args.prompts_per_step} prompts, {large:.0f} MiB at {2 * args.prompts_per_step} ({large / small:.2f}x)")
    return {"micro_batch_size": micro, "peak_mb_above_start": peaks, "ratio": large / small}


def bench_trl_config(args, cfg: tepo.ObjectiveConfig, out: str) -> dict:
    """GRPOConfig's fields for the bench: --engine trl's mapping of our settings (tepo_trl.trl_settings:
    micro-batches -> per-device batch and gradient accumulation, mini-batches -> steps per generation,
    epochs -> num_iterations, precision, checkpointing under TRL's current name, learning rate and its
    warm-up), TRL's own token-level GRPO loss, beta = our objective's when it needs a reference model
    (TRL then loads one, as we do) and 0 otherwise, and --bench-steps + 1 rollouts, none saved or reported."""
    from tepokit.tools.tepo_trl import trl_settings
    optimizer_steps = args.mini_batches * args.epochs                   # per rollout
    return {**trl_settings(args, num_processes=1), "output_dir": out, "loss_type": "dapo",
            "beta": cfg.beta if tepo.needs_ref(args.objective, cfg) else 0.0,
            "max_steps": (args.bench_steps + 1) * optimizer_steps, "save_strategy": "no", "logging_steps": 1,
            "report_to": "none",
            "use_cpu": pick_device(args).type == "cpu", "disable_tqdm": True}


def bench_trl(args, cfg: tepo.ObjectiveConfig, out: str, decode: str = "fp32") -> dict:
    """TRL's GRPOTrainer on the bench's work (bench_trl_config): seconds per rollout over the timed ones, and of
    them its generation's (timing/generate, as ours is named), in our run's decoding precision (decode:
    tepokit/core/sampling.py, decoding). Its console lines go to <out>.log."""
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from tepokit.tools.tepo_trl import ignore_trls_checkpointing_warning
    task = load_task(args)
    start_model = prepare_start_model(args, task, pick_device(args))
    golds = {format_prompt(q): gold_answer(a) for q, a in zip(task["train"]["question"], task["train"]["answer"])}

    def reward_fn(prompts, completions, **kw):
        return [float(parse_strict(c) == golds.get(p)) for p, c in zip(prompts, completions)]

    generations = []                                               # (start, seconds) of each generation call

    class DecodingGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):          # TRL's generation, as ours decodes, timed
            wait_for_the_gpu()
            t0 = time.time()
            with decoding(self.model, decode):
                generated = super()._generate_single_turn(*args, **kwargs)
            wait_for_the_gpu()
            generations.append((t0, time.time() - t0))
            return generated

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *a, **k):
            self.times.append(time.time())

    rollout, optimizer_steps = args.prompts_per_step * args.group_size, args.mini_batches * args.epochs
    prompts = datasets.Dataset.from_dict({"prompt": [format_prompt(q) for q in list(task["train"]["question"])]})
    clock = Clock()
    with quiet(out + ".log"), warnings.catch_warnings():
        ignore_trls_checkpointing_warning()
        config = GRPOConfig(**bench_trl_config(args, cfg, out))
        trainer = DecodingGRPOTrainer(model=start_model, reward_funcs=reward_fn, args=config, train_dataset=prompts,
                              callbacks=[clock])
        t0 = time.time()
        trainer.train()
    ends = [t0] + clock.times
    per_rollout = [ends[i + optimizer_steps] - ends[i]             # the first rollout (untimed) is skipped
                   for i in range(optimizer_steps, len(ends) - optimizer_steps, optimizer_steps)]
    step = sum(per_rollout) / max(1, len(per_rollout))
    timed = sum(seconds for start, seconds in generations if start >= ends[optimizer_steps])   # the timed rollouts'
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_time": step, "timing/generate": timed / max(1, len(per_rollout)),
            "perf/tokens_per_second": rollout * lengths[-1] / step}


def input_check_cost(args, obj_overrides: dict, repeats: int = 30) -> dict:
    """Median seconds of tepo's input checks (_prepare: shapes, 0/1 mask, NaN / inf where
    mask is 1) and of the whole objective call with its backward, on one mini-batch of the bench's
    shape ([rows, max_new_tokens], float32, rows of random lengths) filled with random log-probs."""
    rows = rows_per_minibatch(args.prompts_per_step, args.mini_batches, args.group_size)
    T = args.max_new_tokens
    g = torch.Generator().manual_seed(0)
    old_logp = -torch.rand(rows, T, generator=g) * 3                           # [rows, T]
    logp = (old_logp + 0.1 * torch.randn(rows, T, generator=g)).requires_grad_(True)
    mask = (torch.arange(T) < torch.randint(T // 5, T + 1, (rows, 1), generator=g)).float()   # [rows, T]
    advantages = torch.randn(rows, generator=g)                                # [rows]
    optional = dict(ref_logp=old_logp.clone(), entropy=torch.rand(rows, T, generator=g),
                    old_entropy=torch.rand(rows, T, generator=g), sampler_logp=old_logp.clone())  # each [rows, T]
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
