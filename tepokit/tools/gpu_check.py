"""python -m tepokit.tools.gpu_check: the one-GPU path measured on your card, in one command and a few minutes.

What docs/one-gpu.md reports, measured again on whatever GPU runs it, over models of real shapes with random
weights (tepokit/setup/shapes.py: GPT-2 small, Qwen2.5-0.5B, 1.5B and 3B, built from their configurations;
nothing is downloaded) and prompts of GSM8K's length cut to 256 tokens:

  generation  milliseconds per new token of the rollout's generation (16 prompts x 8 samples = 128 rows, 256 new
              tokens, no end token: every row runs to the end; the whole call over 256, prefill and CUDA-graph capture
              included, and per decode step alone: what 128 more tokens add) for GPT-2's loop and transformers' static
              KV cache (the Qwen shape), each in fp32, TF32 and bf16 (--decode-precision); and how far each one's
              log-probs are from the trainer's fp32 forward over the same tokens: per token (largest, mean) and per
              completion (the mean over its tokens, the sequence-level log-ratio that GSPO and TEPO clip in a band of
              (-3e-4, +4e-4))
  memory      train_small.py --check-memory-on-device for the recipes of docs/one-gpu.md (GRPO: it trains every
              row): each phase's plan beside torch.cuda.max_memory_allocated, and whether it lies within -5% and
              +25% of it
  profile     where generation's time goes, per shape and decoding precision: one call of the generation part's
              under torch.profiler. The GPU's busy time per new token (its kernels' time added up) beside the call's
              wall time (a busy share far below 1: the GPU waits for the host), the kernels launched per token,
              whether the decode step was replayed as a CUDA graph, and the kernels that take most of the time
  bench       train_small.py --bench --bench-shape gpt2-small at the same work (16 x 8 x 256), once per
              --bench-runs run (a fp32 run decoding in TF32 or bf16, TRL's generation in the same one; a
              --precision bf16 run on both sides): our step, with the sampler's old log-probs and recomputing
              them, against TRL's GRPOTrainer, each side's generation apart

Writes gpu_check.json (every number) and gpu_check.md (the tables) to --out, and prints the tables; the profiler's
whole tables go to <out>/profile/. --micro runs the same on 2-layer models of width 64 with the real vocabularies, a
few tokens and (in generation) 4 prompts x 2 samples: a check of the command on any machine (the CPU included), not
a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from statistics import median
from types import SimpleNamespace

import torch

from tepokit.core.clock import wait_for_the_gpu
from tepokit.plumbing.errors import fail
from tepokit.plumbing.rundir import code_version, read_log, utc_now, write_json
from tepokit.tools.bench import device_name

PROGRAM = "python -m tepokit.tools.gpu_check"
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "train_small.py")
PARTS = ("generation", "profile", "memory", "bench")
DECODES = ("fp32", "tf32", "bf16")
# The bench's runs (--bench-runs): a fp32 run decoding in each precision (TRL's generation in the same one), and a
# --precision bf16 run (bf16 autocast for training and decoding on both sides: TRL's bf16=True)
BENCH_RUNS = {"fp32": ["--decode-precision", "fp32"], "tf32": ["--decode-precision", "tf32"],
              "bf16": ["--decode-precision", "bf16"], "bf16-autocast": ["--precision", "bf16"]}
GENERATION_SHAPES = {"gpt2-small": "GPT-2's loop", "qwen2.5-0.5b": "static KV cache"}
# The recipes of docs/one-gpu.md's memory tables: (name, shape, flags). Each adds COMMON_FLAGS.
MEMORY_RUNS = [
    ("Qwen2.5-0.5B, fp32, micro-batches of 4, checkpointing", "qwen2.5-0.5b",
     ["--micro-batch-size", "4", "--gradient-checkpointing"]),
    ("GPT-2 small, fp32, micro-batches of 16", "gpt2-small", ["--micro-batch-size", "16"]),
    ("Qwen2.5-0.5B, fp32, micro-batches of 16", "qwen2.5-0.5b", ["--micro-batch-size", "16"]),
    ("Qwen2.5-0.5B, bf16, micro-batches of 16", "qwen2.5-0.5b", ["--micro-batch-size", "16", "--precision", "bf16"]),
    ("Qwen2.5-0.5B, fp32, micro-batches of 16, bf16 decoding", "qwen2.5-0.5b",
     ["--micro-batch-size", "16", "--decode-precision", "bf16"]),
    ("Qwen2.5-1.5B, LoRA rank 16, micro-batches of 4, checkpointing", "qwen2.5-1.5b",
     ["--lora-rank", "16", "--micro-batch-size", "4", "--gradient-checkpointing"]),
    ("Qwen2.5-3B, LoRA rank 16, bf16 base, micro-batches of 4", "qwen2.5-3b",
     ["--lora-rank", "16", "--lora-base-bf16", "--precision", "bf16", "--micro-batch-size", "4"]),
]
COMMON_FLAGS = ["--objective", "grpo", "--prompts-per-step", "16", "--group-size", "8", "--entropy-check-every", "1",
                "--check-memory-on-device"]
BENCH_FLAGS = ["--bench", "--bench-shape", "gpt2-small", "--prompts-per-step", "16", "--group-size", "8",
               "--bench-repeats", "2"]


def parse(argv=None):
    runs = "\n".join(f"  {i + 1}  {name}" for i, (name, _, _) in enumerate(MEMORY_RUNS))
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"the memory runs (GRPO, 16 x 8 rows of 256 + 256 tokens):\n{runs}")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--out", default=None, help="directory for the results (default: runs/gpu_check__<time>)")
    parser.add_argument("--memory-runs", default="all", help=f"numbers of the memory runs, 1..{len(MEMORY_RUNS)}, "
                        "comma-separated, or all")
    parser.add_argument("--jobs", type=int, default=1, help="memory runs at once (each measures its own process's "
                        "peak, so running several changes no number but their times)")
    parser.add_argument("--bench-runs", default="tf32,bf16,bf16-autocast", help="the bench's runs, comma-separated, "
                        f"of {', '.join(BENCH_RUNS)}: a fp32 run decoding in fp32, TF32 or bf16, or a --precision bf16 "
                        "run (bf16-autocast)")
    parser.add_argument("--micro", action="store_true", help="2-layer models of width 64 and a few tokens: a check "
                        "of the command, not a measurement")
    args = parser.parse_args(argv)
    args.parts = listed(args.parts, PARTS, "--parts")
    args.bench_runs = listed(args.bench_runs, BENCH_RUNS, "--bench-runs")
    numbers = [str(i + 1) for i in range(len(MEMORY_RUNS))]
    args.memory_runs = numbers if args.memory_runs == "all" else listed(args.memory_runs, numbers, "--memory-runs")
    if args.jobs < 1:
        fail(f"argument --jobs: invalid value {args.jobs}: use an integer of 1 or more", PROGRAM)
    if args.out and os.path.exists(args.out) and os.listdir(args.out):
        fail(f"argument --out: {args.out} is not empty; choose a new directory", PROGRAM)
    args.out = args.out or os.path.join("runs", f"gpu_check__{time.strftime('%Y%m%d-%H%M%S')}")
    # generation's rows and lengths: the tables' (16 prompts x 8 samples of 256 + 256 tokens), or --micro's few
    args.prompts, args.group = (4, 2) if args.micro else (16, 8)
    args.prompt_tokens, args.new_tokens = (16, 8) if args.micro else (256, 256)
    return args


def listed(value: str, valid, flag: str) -> list:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        fail(f"argument {flag}: invalid value {value!r}: use a comma-separated list of {', '.join(valid)}", PROGRAM)
    return items


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(args.out, exist_ok=True)              # new, or empty (parse refused one that is not)
    result = {"device": device_name(device), "torch": torch.__version__, "started_at": utc_now(), "micro": args.micro,
              "code": code_version()}
    print(f"{PROGRAM}: {result['device']}, torch {torch.__version__}{', --micro (not a measurement)' * args.micro}; "
          f"results in {args.out}", flush=True)
    data = write_long_problems(os.path.join(args.out, "data.jsonl"))
    shapes = sorted({s for s in GENERATION_SHAPES if {"generation", "profile"} & set(args.parts)}
                    | {MEMORY_RUNS[int(i) - 1][1] for i in args.memory_runs if "memory" in args.parts})
    models = make_models(shapes, data, args, device)
    lock = threading.Lock()

    def keep(rows: list, row: dict) -> None:
        """A measured row into the results, written at once: a check cut short keeps what it measured."""
        with lock:
            rows.append(row)
            write_json(os.path.join(args.out, "gpu_check.json"), result)

    for part, measure in (("generation", lambda rows: measure_generation(models, data, args, device, rows, keep)),
                          ("profile", lambda rows: measure_profile(models, data, args, device, rows, keep)),
                          ("memory", lambda rows: measure_memory(models, data, args, rows, keep)),
                          ("bench", lambda rows: measure_bench(args, rows, keep))):
        if part in args.parts:
            result[part] = []
            measure(result[part])
    result["finished_at"] = utc_now()
    write_json(os.path.join(args.out, "gpu_check.json"), result)
    tables = report(result)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(tables)
    print(tables)
    print(f"written: {os.path.join(args.out, 'gpu_check.json')}, {os.path.join(args.out, 'gpu_check.md')}")
    return result


def write_long_problems(path: str) -> str:
    """600 word problems of GSM8K's kind and more than 256 characters (the models' tokens), 'question' and
    'answer' ('#### n') records, seeded."""
    import random
    draw = random.Random(0)
    with open(path, "w") as f:
        for _ in range(600):
            name, item = draw.choice(["Ann", "Bob", "Cat", "Dan", "Eve"]), draw.choice(["pens", "cups", "shells"])
            counts = [draw.randint(2, 30) for _ in range(8)]
            story = " ".join(f"On day {d + 1} {name} finds {n} more {item} in the old shed behind the house."
                             for d, n in enumerate(counts))
            f.write(json.dumps({"question": f"{story} How many {item} does {name} have now?",
                                "answer": f"{sum(counts)}\n#### {sum(counts)}"}) + "\n")
    return path


def make_models(shapes: list, data: str, args, device) -> dict:
    """Each shape's random-weight model in <out>/models/<shape> (bf16 on disk: runs load it in fp32)."""
    import datasets
    from tepokit.setup.shapes import save_random_model
    with open(data) as f:
        records = [json.loads(line) for line in f]
    task = datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                                 "test": datasets.Dataset.from_list(records[:1])})
    models = {}
    for shape in shapes:
        t0 = time.time()
        models[shape] = save_random_model(shape, task, 0, os.path.join(args.out, "models", shape), micro=args.micro,
                                          dtype=torch.bfloat16, device=device.type)
        print(f"  model {shape}{' (micro)' * args.micro}: {time.time() - t0:.0f} s", flush=True)
    return models


def measure_generation(models: dict, data: str, args, device, rows: list, keep) -> None:
    """Per shape and decoding precision: ms per new token (the whole call over its new tokens, the best of two timed
    calls after an untimed one), ms per decode step (the difference a call of half as many new tokens makes, per
    token: the prefill, the capture and the bf16 cast taken out) and the log-prob gap to the trainer's fp32 forward
    over the same tokens; each row kept (keep) into rows."""
    for shape, sampler in GENERATION_SHAPES.items():
        model, prompt_ids, prompt_mask = loaded(models[shape], data, args, device)

        def timed(decode: str, new_tokens: int) -> tuple:
            return timed_generation(model, prompt_ids, prompt_mask, args.group, new_tokens, decode)

        for decode in DECODES:
            timed(decode, args.new_tokens)                                      # untimed: warm-up
            (whole, out), (again, _) = timed(decode, args.new_tokens), timed(decode, args.new_tokens)
            half, _ = timed(decode, args.new_tokens // 2)
            T = out["completion_ids"].shape[1]
            gap = logprob_gap(model, prompt_ids, prompt_mask, out, rows_per_forward=16)
            keep(rows, {"shape": shape, "sampler": sampler, "decode": decode, "rows": out["completion_ids"].shape[0],
                        "new_tokens": T, "ms_per_token": 1e3 * min(whole, again) / T,
                        "decode_step_ms": 1e3 * (min(whole, again) - half) / (T - args.new_tokens // 2), **gap})
            print(f"  generation {shape} {decode}: {rows[-1]['ms_per_token']:.2f} ms per token "
                  f"({rows[-1]['decode_step_ms']:.2f} per decode step), log-prob gap max {gap['token_max']:.2e}",
                  flush=True)
        model = None
        memory_back(device)


def loaded(path: str, data: str, args, device) -> tuple:
    """(the model at `path` as a run loads it: fp32, on `device`; the prompts [U, P] and their mask)."""
    from tepokit.setup.model import load_policy
    as_a_run = SimpleNamespace(model=path, trust_remote_code=False, chat_template="off", gradient_checkpointing=False)
    model, tokenizer = load_policy(path, as_a_run, device)
    return model, *long_prompts(tokenizer, data, args.prompts, args.prompt_tokens, device)


def memory_back(device) -> None:
    """The GPU's cached blocks back, once the last reference to a model is gone (before the next shape)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_generation(model, prompt_ids, prompt_mask, group: int, new_tokens: int, decode: str) -> tuple:
    """(seconds, the sampler's result) of one rollout's generation as a run makes it, seeded, with no end token."""
    from tepokit.core.sampling import decoding, sample
    torch.manual_seed(0)
    wait_for_the_gpu()
    t0 = time.perf_counter()
    with decoding(model, decode), torch.no_grad():
        out = sample(model, prompt_ids, prompt_mask, group, new_tokens, 1.0, "fp32", "loop", "on",
                     eos_ids=[])                                       # a run's sampler on a GPU, eagerly on a CPU
    wait_for_the_gpu()
    return time.perf_counter() - t0, out


def long_prompts(tokenizer, data: str, prompts: int, prompt_tokens: int, device) -> tuple:
    """`prompts` prompts of exactly prompt_tokens tokens (the problems' last ones, as a run cuts them)."""
    with open(data) as f:
        questions = [json.loads(line)["question"] for line in f][:prompts]
    ids = [tokenizer(q).input_ids[-prompt_tokens:] for q in questions]
    assert min(map(len, ids)) == prompt_tokens, "the problems are shorter than the prompts' length"
    return torch.tensor(ids, device=device), torch.ones(len(ids), prompt_tokens, dtype=torch.long, device=device)


@torch.no_grad()
def logprob_gap(model, prompt_ids, prompt_mask, out: dict, rows_per_forward: int) -> dict:
    """The sampler's log-probs against the trainer's: a fp32 forward over prompt + completion (no TF32), as
    train_small.py recomputes old log-probs, rows_per_forward rows at a time. Largest and mean |gap| per token;
    largest |mean gap| per completion (every completion is full length: no end token)."""
    from tepokit.core.forward import completion_logits, token_logprobs
    group = out["completion_ids"].shape[0] // prompt_ids.shape[0]
    batch = SimpleNamespace(prompt_ids=prompt_ids.repeat_interleave(group, 0),
                            prompt_mask=prompt_mask.repeat_interleave(group, 0),
                            completion_ids=out["completion_ids"],
                            completion_mask=torch.ones_like(out["completion_ids"]))
    trainer = torch.cat([token_logprobs(completion_logits(model, batch, rows, "fp32", prompt_once=True),
                                        batch.completion_ids[rows], 1.0)
                         for rows in torch.arange(batch.completion_ids.shape[0]).split(rows_per_forward)])   # [B, T]
    gap = out["logp"] - trainer                                                                              # [B, T]
    return {"token_max": gap.abs().max().item(), "token_mean": gap.abs().mean().item(),
            "sequence_mean_max": gap.mean(1).abs().max().item()}


def measure_profile(models: dict, data: str, args, device, rows: list, keep) -> None:
    """Per shape and decoding precision: one generation call as the generation part times it (after an untimed
    one), then the same call under torch.profiler. On a GPU: its kernels' time added up per new token (busy), beside
    the timed call's wall time per token, the kernels launched per token, whether the decode step was replayed as a
    CUDA graph (the host's cudaGraphLaunch calls), and the kernels that take most of the time. On a CPU the same of
    torch's operators (a check of the command). Each profiler's whole table in <out>/profile/<shape>_<decode>.txt;
    each row kept (keep) into rows."""
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(os.path.join(args.out, "profile"), exist_ok=True)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu
    for shape, sampler in GENERATION_SHAPES.items():
        model, prompt_ids, prompt_mask = loaded(models[shape], data, args, device)
        for decode in DECODES:
            timed_generation(model, prompt_ids, prompt_mask, args.group, args.new_tokens, decode)      # untimed
            wall, out = timed_generation(model, prompt_ids, prompt_mask, args.group, args.new_tokens, decode)
            with profile(activities=activities) as profiler:
                timed_generation(model, prompt_ids, prompt_mask, args.group, args.new_tokens, decode)
            events = profiler.key_averages()
            with open(os.path.join(args.out, "profile", f"{shape}_{decode}.txt"), "w") as f:
                f.write(events.table(sort_by="self_device_time_total" if on_gpu else "self_cpu_time_total",
                                     row_limit=60, max_name_column_width=100))
            keep(rows, {"shape": shape, "sampler": sampler, "decode": decode, "new_tokens": out["logp"].shape[1],
                        "wall_ms_per_token": 1e3 * wall / out["logp"].shape[1],
                        **where_the_time_goes(events, on_gpu, out["logp"].shape[1])})
            r = rows[-1]
            print(f"  profile {shape} {decode}: busy {r['busy_ms_per_token']:.2f} of {r['wall_ms_per_token']:.2f} ms "
                  f"per token, {r['launches_per_token']:.0f} {r['unit']}s per token", flush=True)
        model = None
        memory_back(device)


def where_the_time_goes(events, on_gpu: bool, new_tokens: int, top: int = 8) -> dict:
    """From the profiler's key_averages: the time of the GPU's kernels (on a CPU, torch's operators' own time)
    added up per new token, their launches per token, whether the host replayed CUDA graphs, and the `top` kernels
    (operators) by time: name, ms and calls per token."""
    from torch.autograd import DeviceType
    if on_gpu:
        timed = [(e.key, e.self_device_time_total, e.count) for e in events if e.device_type == DeviceType.CUDA]
    else:
        timed = [(e.key, e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")]
    timed.sort(key=lambda kernel: -kernel[1])
    per_token = 1e-3 / new_tokens                                                # microseconds -> ms per token
    return {"unit": "kernel" if on_gpu else "operator",
            "busy_ms_per_token": sum(t for _, t, _ in timed) * per_token,
            "launches_per_token": sum(n for _, _, n in timed) / new_tokens,
            "graph_replays": sum(e.count for e in events if e.key.startswith("cudaGraphLaunch")),   # the runtime call
            "top": [{"name": name, "ms_per_token": t * per_token, "calls_per_token": n / new_tokens}
                    for name, t, n in timed[:top]]}


def measure_memory(models: dict, data: str, args, rows: list, keep) -> None:
    """The chosen MEMORY_RUNS, --jobs at a time, each train_small.py --check-memory-on-device in its own process;
    its console in <out>/memory/<number>.log. The steps' final checkpoint and policy are deleted once read. Each
    row kept (keep) into rows as its run ends, then rows put in the runs' order."""
    os.makedirs(os.path.join(args.out, "memory"))
    lengths = ["--max-prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(args.new_tokens)]

    def run(number: str) -> None:
        name, shape, flags = MEMORY_RUNS[int(number) - 1]
        out = os.path.join(args.out, "memory", number)
        argv = [sys.executable, SCRIPT, "--model", models[shape], "--dataset", data, *COMMON_FLAGS, *lengths, *flags,
                "--out", out]
        t0 = time.time()
        with open(out + ".log", "w") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT)
        row = {"number": int(number), "name": name, "shape": shape, "flags": " ".join(flags),
               "seconds": time.time() - t0, "returncode": done.returncode}
        if done.returncode == 0:
            with open(os.path.join(out, "memory_check.json")) as f:
                row.update(json.load(f))
            steps = read_log(os.path.join(out, "run", "metrics.jsonl"))[1:]
            row["second_step_seconds"] = {k[len("timing/"):]: v for k, v in steps[-1].items()
                                          if k.startswith("timing/")}
            for saved in ("checkpoint.pt", "policy"):     # gigabytes of weights, not measurements
                path = os.path.join(out, "run", saved)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                elif os.path.exists(path):
                    os.remove(path)
        print(f"  memory run {number} ({name}): {'done' if done.returncode == 0 else 'FAILED, see ' + out + '.log'} "
              f"in {row['seconds']:.0f} s", flush=True)
        keep(rows, row)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(run, args.memory_runs))
    rows.sort(key=lambda row: row["number"])


def measure_bench(args, rows: list, keep) -> None:
    """--bench at the table's work, once per --bench-runs run; its console in <out>/bench_<run>.log; each row kept
    (keep) into rows."""
    for run in args.bench_runs:
        out = os.path.join(args.out, f"bench_{run}")
        lengths = ["--max-new-tokens", str(args.new_tokens)] + (["--bench-steps", "1"] if args.micro else [])
        # the bench's first side takes the sampler's old log-probs, its second recomputes them (bench.old_logprob_sides)
        argv = [sys.executable, SCRIPT, *BENCH_FLAGS, *lengths, *BENCH_RUNS[run], "--out", out]
        with open(out + ".log", "w") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT)
        row = {"run": run, "returncode": done.returncode}
        if done.returncode == 0:
            with open(os.path.join(out, "bench.json")) as f:
                bench = json.load(f)
            row.update(ratio=bench["ratio"], ratio_recomputed=bench["ratio_recomputed"], device=bench["device"],
                       ours_seconds=[o["step_time"] for o in bench["ours"]],
                       trl_seconds=[t["step_time"] for t in bench["trl"]],
                       ours_phases={k: sum(o[k] for o in bench["ours"]) / len(bench["ours"])
                                    for k in bench["ours"][0] if k.startswith("timing/")},
                       generate_seconds={side: [r["timing/generate"] for r in bench[side]] for side in ("ours", "trl")})
        print(f"  bench, {run}: "
              f"{'%.2fx TRL' % row['ratio']['median'] if done.returncode == 0 else 'FAILED, see ' + out + '.log'}",
              flush=True)
        keep(rows, row)


def report(result: dict) -> str:
    """The tables of gpu_check.md."""
    lines = [f"# gpu_check: {result['device']}, torch {result['torch']}, {result['started_at']} to "
             f"{result['finished_at']}, code {result['code']['commit']}"
             + (" with uncommitted changes" * bool(result["code"]["uncommitted_changes"]))
             + (" (--micro: not a measurement)" * result["micro"]),
             ""]
    if "generation" in result:
        first = result["generation"][0]
        lines += [f"## Generation per new token ({first['rows']} rows, {first['new_tokens']} new tokens: the whole "
                  "call over them)", "",
                  "| shape | sampler | decoding | ms per token | ms per decode step | log-prob gap: token max | "
                  "token mean | completion mean, max |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['sampler']} | {r['decode']} | {r['ms_per_token']:.2f} | "
                  f"{r['decode_step_ms']:.2f} | {r['token_max']:.2e} | {r['token_mean']:.2e} | "
                  f"{r['sequence_mean_max']:.2e} |" for r in result["generation"]]
        lines.append("")
    if "profile" in result:
        lines += profile_tables(result["profile"])
    if "memory" in result:
        measure = ("resident memory (on a CPU it keeps freed blocks: a check of the command, not of the plan)"
                   if result["device"].startswith("CPU") else "torch.cuda.max_memory_allocated")
        lines += [f"## Memory: the plan against {measure}, every phase", "",
                  "| # | run | plan (phase) | measured (phase) | plan / measured | each phase's plan / measured | "
                  "within -5%/+25% |", "|---|---|---|---|---|---|---|"]
        for r in result["memory"]:
            if r["returncode"] != 0:
                lines.append(failed(f"{r['number']} | {r['name']}", r["returncode"], columns=7))
                continue
            ratios = {p: r["planned_mb"][p] / r["measured_mb"][p] for p in r["planned_mb"] if r["measured_mb"][p] > 0}
            lines.append(f"| {r['number']} | {r['name']} | {r['planned_peak_mb'] / 1024:.2f} GiB "
                         f"({r['planned_phase']}) | {r['measured_peak_mb'] / 1024:.2f} GiB ({r['measured_phase']}) | "
                         f"{r['planned_peak_mb'] / r['measured_peak_mb']:.2f} | "
                         + ", ".join(f"{p} {v:.2f}" for p, v in ratios.items())
                         + f" | {'yes' if all(0.95 <= v <= 1.25 for v in ratios.values()) else 'NO'} |")
        lines.append("")
    if "bench" in result:
        lines += ["## --bench: our step against TRL's GRPOTrainer (GPT-2 small shape, 16 x 8 x 256)", "",
                  "| run | ours (the sampler's old log-probs), s per step | TRL, s per step | TRL / ours (median, "
                  "range) | TRL / ours recomputing the old log-probs | of the step, generation: ours, TRL | the rest: "
                  "ours, TRL |", "|---|---|---|---|---|---|---|"]
        for r in result["bench"]:
            if r["returncode"] != 0:
                lines.append(failed(r["run"], r["returncode"], columns=7))
                continue
            ratio, again = r["ratio"], r["ratio_recomputed"]
            ours, trl = (median(r[f"{side}_seconds"]) for side in ("ours", "trl"))
            ours_gen, trl_gen = (median(r["generate_seconds"][side]) for side in ("ours", "trl"))
            lines.append(f"| {r['run']} | {', '.join('%.3f' % s for s in r['ours_seconds'])} | "
                         f"{', '.join('%.3f' % s for s in r['trl_seconds'])} | {ratio['median']:.2f}x "
                         f"({ratio['min']:.2f}-{ratio['max']:.2f}) | {again['median']:.2f}x | {ours_gen:.3f}, "
                         f"{trl_gen:.3f} s | {ours - ours_gen:.3f}, {trl - trl_gen:.3f} s |")
        lines.append("")
    return "\n".join(lines)


def profile_tables(rows: list) -> list:
    """The profile part's tables: where each call's time goes, then each call's largest kernels (operators)."""
    unit = rows[0]["unit"]
    lines = ["## Where generation's time goes (torch.profiler over one call of the generation part's)", "",
             f"| shape | decoding | ms per token | {unit}s' time, ms per token | busy share | {unit}s per token | "
             "CUDA graph replays |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['decode']} | {r['wall_ms_per_token']:.2f} | {r['busy_ms_per_token']:.2f} | "
              f"{r['busy_ms_per_token'] / r['wall_ms_per_token']:.2f} | {r['launches_per_token']:.0f} | "
              f"{r['graph_replays']} |" for r in rows]
    lines += ["", f"The largest {unit}s, ms per new token (calls per new token):", "",
              f"| shape | decoding | the largest {unit}s |", "|---|---|---|"]
    lines += [f"| {r['shape']} | {r['decode']} | "
              + "; ".join(f"`{short(k['name'])}` {k['ms_per_token']:.3f} ({k['calls_per_token']:.1f})"
                          for k in r["top"]) + " |" for r in rows]
    return lines + [""]


def short(name: str, width: int = 90) -> str:
    """A kernel's name for a table cell: without its return type and torch's namespaces, at most `width` long (an
    elementwise kernel's template arguments say which operation it is)."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at::", "std::"):
        name = name.replace(noise, "")
    name = name.replace("|", "/").replace("`", "'")
    return name if len(name) <= width else name[:width - 3] + "..."


def failed(label: str, returncode: int, columns: int) -> str:
    """A table row for a run that failed: its label, its exit status (its log says why), empty cells."""
    cells = label.count("|") + 2
    return f"| {label} | failed (exit {returncode}); see its log |" + " |" * (columns - cells)


if __name__ == "__main__":
    main()
