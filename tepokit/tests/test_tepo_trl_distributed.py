"""tepokit/tools/tepo_trl.py in two processes (torchrun, gloo, CPU) against one process on the same global batch
(tepokit/tests/fixed_batch_step.py): one optimizer step gives the same loss and parameters, and the logged
metrics are those of the global batch; a token count that is not gathered over processes breaks it."""
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

from tepokit.cli import resume
from tepokit.tests.fixed_batch_step import expected_reward_mean, one_step, save_tiny_model
from tepokit.tests.helpers import MICRO, REPO, SCRIPT, read_completions

# objective -> rows per micro-batch of its one-process reference. TEPO (token-mean) reads the statistics of
# the micro-batch in its mask (entropy_criterion="cov"), per process as in verl: its reference accumulates
# the two processes' micro-batches of 4 rows. GRPO (per-sequence mean, reference log-probs) has no batch
# statistic: its reference is the whole batch in one micro-batch. (Token counts of a micro-batch in place of
# the step's are caught in one process, by test_tepo_trl.py's parity with TRL's dapo loss.)
REFERENCE_MICRO_BATCH = {"tepo": 4, "grpo": 8}
PER_RANK_TOKEN_COUNT = "tepo:per_rank_token_count"
PARAMETER_ATOL = 1e-6                          # float32; measured differences are about 2e-9
# the loss is a sum of terms of either sign (about 0.05 each) and can be near 0: an absolute float32 bound too
LOSS_TOLERANCE = dict(rel=1e-6, abs=1e-7)
TOKEN_MEANS = ("clip_ratio/region_mean", "kl_old/k1", "entropy")      # means over valid tokens
# a folder whose sitecustomize.py makes each process write down what its reward function scored
RECORD_SCORES = os.path.join(os.path.dirname(__file__), "record_scores")
# what a run of one RL step leaves (the Trainer saves a checkpoint at its last step), written by the main process
# but for rng_state_1.pth, process 1's RNG state in the checkpoint
RUN_DIRECTORY_FILES = [".lock", "README.md", "checkpoint-2", "completions.jsonl", "config.json", "metrics.jsonl",
                       "policy", "summary.json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("trl")
    path = str(tmp_path_factory.mktemp("tiny_gpt2"))
    save_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one_process"))
    return {objective: one_step(model_dir, objective, out, micro_batch)
            for objective, micro_batch in REFERENCE_MICRO_BATCH.items()}


def torchrun_two_processes(argv, cwd, env=None, pythonpath=()):
    """`torchrun --standalone --nproc_per_node 2 <argv>` on the CPU (gloo); --standalone picks a free port for
    the rendezvous. Bounded: a process that waits for a dead peer would otherwise hang the tests. `env` and
    `pythonpath` (folders put first) are added to this process's environment."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [*pythonpath, REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def two_processes(model_dir, tmp_path_factory):
    """One launch for every case: torch and TRL are imported once per process."""
    out = str(tmp_path_factory.mktemp("two_processes"))
    cases = [*REFERENCE_MICRO_BATCH, PER_RANK_TOKEN_COUNT]
    torchrun_two_processes(["-m", "tepokit.tests.fixed_batch_step", model_dir, out, *cases], cwd=REPO)
    return {case: torch.load(os.path.join(out, case.replace(":", "_") + ".pt"), weights_only=False) for case in cases}


def initial_parameters(model_dir):
    from transformers import AutoModelForCausalLM
    return torch.cat([p.detach().flatten() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters()])


def token_weighted(micro_batches, name):
    return sum(metrics[name] * tokens for metrics, tokens in micro_batches) / sum(t for _, t in micro_batches)


@pytest.mark.parametrize("objective", list(REFERENCE_MICRO_BATCH))
def test_two_processes_make_the_one_process_step(objective, model_dir, one_process, two_processes):
    one, two = one_process[objective], two_processes[objective]
    update = (one["params"] - initial_parameters(model_dir)).abs().max().item()
    assert update > 1e-3                                                   # a real step, not a zero gradient
    assert (two["params"] - one["params"]).abs().max().item() < PARAMETER_ATOL
    assert two["log"]["loss"] == pytest.approx(one["log"]["loss"], **LOSS_TOLERANCE)
    # the logged loss parts are the step's, whatever the split into processes and micro-batches
    beta = {"tepo": 1.0, "grpo": 0.04}[objective]
    for log in (one["log"], two["log"]):
        assert log["pg_loss"] + beta * log["kl_loss"] == pytest.approx(log["loss"], **LOSS_TOLERANCE)
    # rewards are gathered before advantages: the mean over all 8 rows (the two groups' means are 0.75, 1.25)
    assert one["log"]["reward"] == two["log"]["reward"] == pytest.approx(expected_reward_mean()) == 1.0
    assert one["log"]["reward_std"] == pytest.approx(two["log"]["reward_std"])
    # means over valid tokens are over both processes' tokens (24 and 20), each process weighted by its own
    process_tokens = [tokens for _, tokens in one["micro_batches"]]
    for name in TOKEN_MEANS:
        if process_tokens == [24, 20]:          # the one-process micro-batches are the processes' rows
            expected = token_weighted(one["micro_batches"], name)
        else:                                   # one micro-batch: the global mean itself
            assert process_tokens == [44]
            expected = one["log"][name]
        assert two["log"][name] == pytest.approx(expected, rel=1e-6), name
    if objective == "tepo":
        # the unweighted mean of the two processes' values differs, so the check above can fail
        assert two["log"]["clip_ratio/region_mean"] != pytest.approx(one["log"]["clip_ratio/region_mean"], rel=1e-3)
        assert 0 < two["log"]["kl_mask/frac"] < 1 and 0 < two["log"]["clip_ratio/region_mean"] < 1   # both act
        assert two["log"]["kl_mask/frac"] == pytest.approx(token_weighted(one["micro_batches"], "kl_mask/frac"))


def test_tepo_mask_reads_each_process_micro_batch_not_the_global_batch(model_dir, two_processes, tmp_path):
    """The documented choice (tepo_trl's docstring): with the whole batch in one micro-batch, the covariance
    means of TEPO's mask are the global batch's, the mask and so the update differ from two processes'."""
    whole = one_step(model_dir, "tepo", str(tmp_path), micro_batch=8)
    two = two_processes["tepo"]
    assert whole["log"]["kl_mask/frac"] != pytest.approx(two["log"]["kl_mask/frac"], rel=1e-3)
    assert (whole["params"] - two["params"]).abs().max().item() > 100 * PARAMETER_ATOL


def test_a_per_process_token_count_breaks_the_step(one_process, two_processes):
    """Negative control: each process normalising by its own 24 or 20 tokens instead of 44 / 2."""
    one, two = one_process["tepo"], two_processes[PER_RANK_TOKEN_COUNT]
    assert (two["params"] - one["params"]).abs().max().item() > 100 * PARAMETER_ATOL
    assert two["log"]["loss"] != pytest.approx(one["log"]["loss"], rel=1e-4)


def test_train_small_engine_trl_under_torchrun_is_one_run_that_logs_the_global_rollout(tmp_path):
    """The scale-out command of docs/scaling-out.md on the CPU, one whole RL step, generation included. One run:
    process 0 holds the run directory's lock and writes it (one summary, one log); the rollout of R = 2 prompts
    x 4 completions is split into 4 per process; and the logged step holds the metrics of all 8 completions, not
    of one process's 4, checked against what each process's reward function scored (written down by
    record_scores/sitecustomize.py, outside the code under test). A longer warm-up gives mixed rewards, so that
    the metrics of one process's half would differ. (Before accelerate was told cpu=True, each process
    ran alone as process 0 and the second was refused the run directory the first held.)"""
    pytest.importorskip("trl")
    record = tmp_path / "scores"
    record.mkdir()
    done = torchrun_two_processes([SCRIPT, *MICRO, "--warmup-steps", "300", "--threads", "1", "--engine", "trl",
                                   "--objective", "tepo", "--steps", "1", "--save-every", "100", "--out", "runs/two"],
                                  cwd=tmp_path, env={"TEPO_RECORD_SCORES": str(record)}, pythonpath=[RECORD_SCORES])
    run_dir = tmp_path / "runs" / "two"                  # torchrun exits 0: so did both processes
    assert done.stdout.count("held-out accuracy") == 1 and "Traceback" not in done.stderr
    # each process scored its own 4 completions, once: the rollout of one RL step
    scored = [[json.loads(line) for line in open(record / f"process_{rank}.jsonl")] for rank in (0, 1)]
    assert [len(calls) for calls in scored] == [1, 1]
    shares = [calls[0] for calls in scored]                  # in the global order: process 0's rows first
    assert [len(share["texts"]) for share in shares] == [4, 4] and shares[0]["pid"] != shares[1]["pid"]
    assert open(run_dir / ".lock").read().strip() == str(shares[0]["pid"])     # process 0 owns the directory
    assert sorted(os.listdir(run_dir)) == RUN_DIRECTORY_FILES
    checkpoint = run_dir / "checkpoint-2"
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(checkpoint)) and not os.path.exists(
        checkpoint / "rng_state.pth")
    assert resume.trl_checkpoint_problem(str(checkpoint)) is None       # whole, as --resume checks it
    trl_config = json.load(open(run_dir / "config.json"))["grpo_config"]
    assert trl_config["per_device_train_batch_size"] * trl_config["steps_per_generation"] == 4
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[1]
    # the logged metrics are the 8 completions': rewards (--reward lenient), their spread and the accuracies
    rewards = shares[0]["lenient"] + shares[1]["lenient"]
    assert len(set(rewards)) == 2                   # mixed: one process's 4 give another mean or another spread
    for share in shares:
        half = share["lenient"]
        assert (statistics.mean(half), statistics.stdev(half)) != pytest.approx(
            (statistics.mean(rewards), statistics.stdev(rewards)))
    logged = rows[1]
    assert logged["reward"] == pytest.approx(statistics.mean(rewards), abs=1e-6)
    assert logged["reward_std"] == pytest.approx(statistics.stdev(rewards), abs=1e-6)
    assert logged["accuracy/lenient"] == pytest.approx(statistics.mean(rewards), abs=1e-6)
    assert logged["accuracy/strict"] == pytest.approx(statistics.mean(shares[0]["strict"] + shares[1]["strict"]),
                                                      abs=1e-6)
    # groups are 4 consecutive rows of the global order (one prompt, one gold answer), whichever process holds them
    golds = shares[0]["golds"] + shares[1]["golds"]
    groups = [range(start, start + 4) for start in (0, 4)]
    assert all(len({golds[i] for i in group}) == 1 for group in groups)
    zero_spread = [float(len({rewards[i] for i in group}) == 1) for group in groups]
    assert logged["frac_reward_zero_std"] == pytest.approx(statistics.mean(zero_spread))
    # completions.jsonl, written by process 0, holds both groups: each process's texts and rewards, in that order
    logged_prompts = read_completions(run_dir)
    assert [row["step"] for row in logged_prompts] == [1, 1]
    for row, share in zip(logged_prompts, shares):
        assert [c["text"] for c in row["completions"]] == share["texts"]
        assert row["group_rewards"] == share["lenient"] and row["gold"] == str(share["golds"][0])
