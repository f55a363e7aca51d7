"""tepokit/tools/memory.py: the memory plan, --dry-run, refusing a run that would not fit, measured peaks."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import train_small as ts
import tepokit.tools.memory
from tepokit.cli.flags import parse_args
from tepokit.tools.memory import PHASES, check_memory
from tepokit.plumbing.peak_memory import peak_memory_mb, reset_peak_memory
from tepokit.setup.task import load_task
from tepokit.core.reward import format_prompt
from tepokit.tests.helpers import SCRIPT, MICRO, make_model_dir, run_main, read_rows


def test_dry_run_prints_the_plan_and_creates_nothing(workdir, capsys):
    run_main([*MICRO, "--dry-run", "--out", "runs/dry"])
    out = capsys.readouterr().out
    assert "memory plan" in out and "estimated peak (" in out and all(f"\n    {phase} " in out for phase in PHASES)
    assert not os.path.exists("runs/dry")


def test_a_run_that_fits_on_the_cpu_prints_the_plan_in_one_line(workdir, capsys):
    """The parts are for --dry-run, a GPU, or a run that would not fit; otherwise the peak, in one line."""
    run_main([*MICRO, "--steps", "1", "--out", "runs/fits"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "memory" in line or "GiB" in line]
    assert len(lines) == 1 and re.fullmatch(r"memory plan: estimated peak [\d.]+ GiB \((generation|evaluation|old "
                                            r"log-probs|update|entropy check)\) of [\d.]+ GiB available on this "
                                            r"machine \([\d.]+M parameters; --dry-run shows each part\)", lines[0])


def test_a_run_that_would_not_fit_is_refused_in_one_line(workdir, monkeypatch, capsys):
    monkeypatch.setattr(tepokit.tools.memory, "device_memory", lambda device: 2**20)          # a 1 MiB device
    with pytest.raises(SystemExit) as e:
        ts.main([*MICRO, "--out", "runs/too_big"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "exceeds" in err[0] and "--force" in err[0]
    assert "each phase adds" in captured.out                   # the plan in full: here it matters
    assert not os.path.exists("runs/too_big")
    args, overrides = parse_args(ts.Args, [*MICRO, "--force"])
    check_memory(args, load_task(args), torch.device("cpu"), False)    # --force: no refusal


def test_gradient_checkpointing_on_a_model_without_it_is_refused_in_one_line(workdir, monkeypatch, capsys):
    """transformers marks each architecture with supports_gradient_checkpointing; one without it
    (here GPT-2, marked so for the test) is refused before anything is created or loaded."""
    from transformers import GPT2PreTrainedModel
    monkeypatch.setattr(GPT2PreTrainedModel, "supports_gradient_checkpointing", False)
    with pytest.raises(SystemExit) as e:
        ts.main([*MICRO, "--gradient-checkpointing", "--out", "runs/no_ckpt"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gradient-checkpointing" in err[0] and "does not support" in err[0]
    assert not os.path.exists("runs/no_ckpt")


def test_peak_memory_restarts_with_each_run():
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc")
    big = torch.ones(64 * 2**20 // 4)                                         # 64 MiB, touched
    del big
    before = peak_memory_mb(torch.device("cpu"))
    reset_peak_memory(torch.device("cpu"))
    assert peak_memory_mb(torch.device("cpu")) < before - 32


# The peak resident memory of real runs, on the real vocabulary size of Qwen2.5 (151,936) in a 2-layer
# Qwen2 of width 64 with a local 151,936-token tokenizer (the plan is held against the tensor bytes of each
# phase in test_memory_plan.py). glibc's heap keeps freed blocks below its (adaptive) mmap threshold, so
# resident memory would count freed tensors: the runs fix the threshold at 1 MiB, which makes resident
# memory follow the live tensors.
QWEN_VOCAB = 151_936


@pytest.fixture(scope="module")
def measured_runs(tmp_path_factory):
    """Two 2-step GRPO runs in subprocesses on the 151,936-token micro model: (prompts per step,
    micro-batch size) -> measured peak minus the memory before the model, MiB."""
    d = tmp_path_factory.mktemp("qwen_vocab")
    with open(d / "data.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"question": f"Ann has {i} pens and gets {i + 1} more. How many pens now?",
                                "answer": f"#### {2 * i + 1}"}) + "\n")
    model_dir = make_model_dir(d / "model", QWEN_VOCAB)
    # The two processes run at once, one thread each: a process's peak is its own, and the suite waits for
    # the slowest instead of the sum.
    runs = {(prompts, micro): start_measured_run(model_dir, str(d / "data.jsonl"), str(d / f"p{prompts}m{micro}"),
                                                 prompts, micro)
            for prompts, micro in ((4, 4), (8, 4))}
    return {config: measured_peak(*run) for config, run in runs.items()}


def start_measured_run(model_dir: str, data: str, out: str, prompts: int, micro: int) -> tuple:
    argv = [sys.executable, SCRIPT, "--model", model_dir, "--dataset", data, "--objective", "grpo", "--beta", "0",
            "--steps", "2", "--prompts-per-step", str(prompts), "--group-size", "4", "--mini-batches", "1",
            "--micro-batch-size", str(micro), "--max-new-tokens", "16", "--overlong-cache", "4",
            "--max-prompt-tokens", "16", "--n-test", "2", "--pass-k", "2", "--pass-k-problems", "1",
            "--eval-every", "100", "--entropy-check-rows", "4", "--no-check-sampling-logprobs", "--threads", "1",
            "--out", out]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), out


def measured_peak(process, out: str) -> float:
    """Measured peak minus the memory before the model, MiB, of a finished run."""
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-2000:]
    rows = read_rows(out)
    return max(row["perf/peak_memory_mb"] for row in rows[1:]) - rows[0]["memory/process_before_model_mb"]


def test_doubling_the_rollout_at_a_fixed_micro_batch_raises_the_peak_less_than_20_percent(measured_runs):
    small, large = measured_runs[(4, 4)], measured_runs[(8, 4)]
    assert large < 1.2 * small, (small, large)


def test_the_memory_check_runs_the_plans_worst_case_and_prints_each_phase_beside_its_plan(tmp_path, capsys):
    """--check-memory-on-device: the plan in full, then 2 RL steps of TEPO (whose dynamic sampling would drop
    groups) with every row trained, every completion --max-new-tokens long though the model has an end
    token, every prompt at least --max-prompt-tokens long; each phase's measured peak beside its plan, in
    the output and in memory_check.json. The sampler's end tokens are as before after it."""
    from tepokit.core import forward
    from tepokit.core import sampling
    from transformers import AutoTokenizer
    model_dir = make_model_dir(tmp_path / "model", vocab_size=512)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"question": f"Ann has {i} pens. How many?", "answer": f"#### {i}"}) + "\n")
    run_main(["--check-memory-on-device", "--model", model_dir, "--dataset", str(tmp_path / "data.jsonl"),
              "--prompts-per-step", "2", "--group-size", "4", "--max-prompt-tokens", "40", "--max-new-tokens", "8",
              "--micro-batch-size", "4", "--entropy-check-rows", "4", "--threads", "1",
              "--out", str(tmp_path / "check")])
    out = capsys.readouterr().out
    assert "each phase adds" in out                                  # the plan in full
    result = json.load(open(tmp_path / "check" / "memory_check.json"))
    for phase in PHASES:
        line = next(line for line in out.splitlines() if line.startswith(phase + " "))
        planned, measured = result["planned_mb"][phase], result["measured_mb"][phase]
        assert line[len(phase):].split() == [f"{planned / 1024:.2f}", "GiB", f"{measured / 1024:.2f}", "GiB",
                                             f"{planned / measured:.2f}" if measured > 0 else "-"], line
    # the training phases hold the model's gradients and Adam's moments: above the start on any device
    assert all(result["measured_mb"][phase] > 0 for phase in ("old log-probs", "update"))
    assert re.search(r"^peak: planned [\d.]+ GiB \(\w[\w -]*\), measured [\d.]+ GiB \(\w[\w -]*\): plan/measured "
                     r"[\d.]+$", out, re.M)
    assert "completions: mean length 8 of --max-new-tokens 8; rows trained: 100%" in out
    rows = read_rows(tmp_path / "check" / "run")
    assert len(rows) == 3 and all(r["completions/mean_length"] == 8 and r["dynamic_sampling/kept_frac"] == 1
                                  and "entropy_change/measured" in r for r in rows[1:])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = [json.loads(line)["question"] for line in open(tmp_path / "check" / "data.jsonl")]
    assert min(len(tokenizer(format_prompt(q)).input_ids) for q in questions) >= 40
    assert sampling.eos_ids_of is forward.eos_ids_of          # the check put back what it patched
