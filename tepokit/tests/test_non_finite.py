"""tepokit/plumbing/non_finite.py: a run that diverges stops at that step in one line, saves nothing non-finite, keeps
its last checkpoint and exits with status 3."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import train_small as ts
from tepokit.plumbing.non_finite import Diverged
from tepokit.tests.helpers import MICRO, SCRIPT, read_rows


def finite_checkpoint_step(run_dir) -> int:
    """The step of a run directory's checkpoint.pt, after checking that every tensor in it is finite."""
    checkpoint = torch.load(os.path.join(run_dir, "checkpoint.pt"), weights_only=True)
    tensors = list(checkpoint["model"].values()) + [t for s in checkpoint["optimizer"]["state"].values()
                                                    for t in s.values() if torch.is_tensor(t)]
    assert all(bool(t.isfinite().all()) for t in tensors)
    return checkpoint["step"]


def test_a_learning_rate_that_diverges_stops_in_one_line_and_keeps_a_finite_checkpoint(tmp_path):
    """From the committed start model, --lr 1e3: step 1's gradient norm is NaN. The run stops there, and neither
    the log nor the checkpoint holds the step; --resume from that checkpoint, in a process of its own, ends
    the same way: one line naming the step and a lower --lr, exit status 3, no traceback."""
    run_dir = str(tmp_path / "run")
    with pytest.raises(Diverged) as diverged:
        ts.main(["--objective", "grpo", "--lr", "1e3", "--steps", "3", "--pass-k-problems", "8", "--out", run_dir])
    assert diverged.value.message == (f"step 1: its grad_norm is nan, at --lr 1000; nothing of step 1 was saved, "
                                      f"and {run_dir}/checkpoint.pt, the last checkpoint before it, is finite; start "
                                      f"again with a lower --lr (--lr 100, say) and --out {run_dir} --overwrite")
    assert [r["step"] for r in read_rows(run_dir)] == [0] and finite_checkpoint_step(run_dir) == 0
    done = subprocess.run([sys.executable, SCRIPT, "--resume", run_dir], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"train_small.py: diverged: {diverged.value.message}"
    assert [r["step"] for r in read_rows(run_dir)] == [0] and finite_checkpoint_step(run_dir) == 0


@pytest.mark.parametrize("error", [
    ValueError("logp: 3 non-finite values where mask is 1 (e.g. row 0, position 2); fix whatever produced it"),
    RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"),
    "nan loss", "infinite gradient norm", "nan weight"])
def test_each_kind_of_divergence_ends_the_run_at_its_step_before_it_is_saved(workdir, monkeypatch, error):
    """Step 2 diverges, in each way: tepo.py's check of non-finite log-probs, the sampler's probabilities, a NaN
    loss or an infinite gradient norm in the step's metrics, a NaN weight. Step 1 stays logged and checkpointed."""
    real_rl_step, out = ts.rl_step, f"runs/diverged_{len(str(error))}"

    def rl_step(run, step, observe=None):
        record = real_rl_step(run, step, observe=observe)
        if step == 2:
            if isinstance(error, Exception):
                raise error
            key, value = {"nan loss": ("loss", math.nan), "infinite gradient norm": ("grad_norm", math.inf),
                          "nan weight": (None, None)}[error]
            if key:                        # the loss's metrics, which the step's row carries
                record.losses = {**record.losses, key: value}
            else:
                with torch.no_grad():
                    next(run.model.parameters())[0] = math.nan
        return record

    monkeypatch.setattr(ts, "rl_step", rl_step)
    with pytest.raises(Diverged) as diverged:
        ts.main([*MICRO, "--objective", "tepo", "--steps", "3", "--out", out])
    assert diverged.value.exit_status == 3 and diverged.value.message.startswith("step 2: ")
    assert "\n" not in diverged.value.message and "lower --lr" in diverged.value.message
    assert [r["step"] for r in read_rows(out)] == [0, 1]
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "details.jsonl"))] == [1]
    assert finite_checkpoint_step(out) == 1 and not os.path.exists(os.path.join(out, "summary.json"))


def test_other_errors_are_not_taken_for_divergence(workdir, monkeypatch):
    def rl_step(run, step, observe=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(ts, "rl_step", rl_step)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        ts.main([*MICRO, "--objective", "grpo", "--steps", "1", "--out", "runs/not_diverged"])


def test_a_warm_up_that_diverges_stops_in_one_line_and_caches_nothing(tmp_path):
    with pytest.raises(Diverged) as diverged:
        ts.main([*MICRO, "--warmup-lr", "1e6", "--steps", "1", "--out", str(tmp_path / "run"), "--cache-dir",
                 str(tmp_path / "cache")])
    assert diverged.value.message.startswith("warm-up step ") and "at --warmup-lr 1e+06; nothing was cached; start " \
        "again with a lower --warmup-lr" in diverged.value.message, diverged.value.message
    assert [p for p in os.listdir(tmp_path / "cache") if not p.endswith(".lock")] == []
    assert not os.path.exists(tmp_path / "run")
