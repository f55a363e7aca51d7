"""tepokit/tools/tepo_trl.py: TEPO and the other objectives inside TRL's GRPOTrainer (parity with TRL's own loss),
--engine trl."""
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

import tepo
import train_small as ts
from tepokit.cli import resume
from tepokit.cli.flags import parse_args
from tepokit.plumbing.signals import Stopped
from tepokit.setup.model import prepare_start_model
from tepokit.setup.task import load_task
from tepokit.tests.helpers import (MICRO, assert_refused_in_one_line, line_of, read_completions, read_rows, rows_in,
                                   run_main, signal_at, start_process, wait_until, warnings_of, without_timing)


TRL_PARITY = {   # case: (tepo objective, its config overrides, TRL's own loss settings)
    "dapo": ("dapo", {}, dict(loss_type="dapo")),
    "grpo_beta0": ("grpo", {"beta": 0.0}, dict(loss_type="grpo")),
    "grpo_beta0.04": ("grpo", {}, dict(loss_type="grpo")),
    "dr_grpo": ("dr_grpo", {}, dict(loss_type="dr_grpo")),
    "gspo": ("gspo", {}, dict(loss_type="grpo", importance_sampling_level="sequence")),
    # CISPO as TRL has it, an absolute cap on the weight (tepo's default is verl's two-sided clip)
    "cispo_cap": ("cispo", {"cispo_weight": "cap", "eps_high": 1.2}, dict(loss_type="cispo")),
    "sapo": ("sapo", {}, dict(loss_type="sapo")),
    # TRL's GMPO is trl.experimental.gmpo.GMPOTrainer, its own loss over GRPOTrainer's rollout (THEIR_LOSS)
    "gmpo": ("gmpo", {}, dict(loss_type="grpo")),
}
THEIR_LOSS = {"gmpo": ("trl.experimental.gmpo", "GMPOTrainer")}   # otherwise trl's GRPOTrainer


def reward_by_length(completions, **_):
    """A reward that differs within groups even for an untrained model: the length mod 3."""
    return [float(len(c) % 3) for c in completions]


@pytest.fixture(scope="module")
def trl_model(workdir):
    """The micro built-in model directory (warmed up and cached like the other micro runs)."""
    pytest.importorskip("trl")
    args, _ = parse_args(ts.Args, MICRO)
    return prepare_start_model(args, load_task(args), torch.device("cpu"))


def parity_trainer(model_dir, objective, cfg, trl_loss, out):
    import datasets
    from tepokit.tools import tepo_trl
    config = tepo_trl.grpo_config(
        objective, cfg, output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=12, temperature=1.0, top_k=0, top_p=1.0, seed=0, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", activation_checkpointing=False, disable_dropout=True,
        **trl_loss)
    prompts = datasets.Dataset.from_dict({"prompt": ["Ann has 2 eggs and gets 1 more. How many eggs now?\n",
                                                     "Bob has 2 bags of 2 pens. How many pens in all?\n"]})
    return tepo_trl.TepoGRPOTrainer(model=model_dir, reward_funcs=reward_by_length, args=config,
                                    train_dataset=prompts, objective=objective, objective_config=cfg)


def one_accumulated_step(trainer, compute_loss, micro_batches):
    """Sum of the micro-batch losses, backward, one SGD step on a copy: (loss, grads, params).
    SGD, not Adam: Adam's first step is lr * g / (|g| + 1e-8), which turns float32 rounding on a
    gradient of size 1e-8 into a difference of size lr; SGD's update shows the gradient itself."""
    model = copy.deepcopy(trainer.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    total = 0.0
    for batch in micro_batches:
        loss = compute_loss(trainer, model, batch)
        loss.backward()
        total += loss.item()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return total, grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", list(TRL_PARITY))
def test_trl_parity_one_step(case, trl_model, tmp_path):
    from trl.trainer.utils import split_tensor_dict
    objective, overrides, trl_loss = TRL_PARITY[case]
    cfg = tepo.config_for(objective, **overrides)
    trainer = parity_trainer(trl_model, objective, cfg, trl_loss, str(tmp_path))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2          # as Trainer's loop sets it
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in trainer.train_dataset["prompt"] for _ in range(4)]   # 2 groups of G = 4
    inputs = trainer._generate_and_score_completions(rows)
    # TRL's advantages are tepo's group_advantages with TRL's epsilon 1e-4
    rewards = torch.tensor(list(trainer._logs["rewards"]["reward_by_length"])[-8:])
    assert rewards.std() > 0
    expected = tepo.group_advantages(rewards, 4, cfg.advantage_scale, eps=1e-4)
    torch.testing.assert_close(inputs["advantages"].float(), expected.float(), atol=1e-6, rtol=1e-6)
    # off-policy old and reference log-probs (seeded), so that clipping and the KL term act
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, ids.shape[1] -
                                                                inputs["prompt_ids"].shape[1])
    noise = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=noise)
    if cfg.beta > 0:
        inputs["ref_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=noise)
    micro_batches = split_tensor_dict(inputs, 2)
    module, trainer_class = THEIR_LOSS.get(case, ("trl", "GRPOTrainer"))
    their_trainer = getattr(__import__(module, fromlist=[trainer_class]), trainer_class)
    theirs = one_accumulated_step(trainer, their_trainer._compute_loss, micro_batches)
    ours = one_accumulated_step(trainer, type(trainer)._compute_loss, micro_batches)
    assert ours[0] == pytest.approx(theirs[0], abs=1e-5)
    for name, a, b in (("gradient", ours[1], theirs[1]), ("parameter", ours[2], theirs[2])):
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) < 1e-5, name
    assert max(g.abs().max().item() for g in ours[1]) > 1e-3                 # a real update, not zero
    logged = trainer._metrics["train"]
    if objective != "sapo":                                                  # SAPO's gate clips nothing
        assert 0 < logged["clip_ratio/region_mean"][-1] < 1                  # the clip acted on some tokens
    if cfg.beta > 0:
        assert logged["kl"][-1] > 0                                          # tepo's kl_ref under TRL's name


# The objectives TRL does not have, and CISPO, GMPO and SAPO with tepo's defaults (verl's CISPO clip; the
# parity test above checks TRL's own forms), run end to end through `train_small.py --engine trl`: two RL
# steps, two epochs per rollout (the second pass is off-policy, so masks and penalties can act),
# finite losses, and each objective's own metric in metrics.jsonl next to TRL's.
# tepo_measured needs the rollout entropy that TepoGRPOTrainer adds to TRL's batch (tepo raises without it).
TRL_OWN_METRIC = {"tepo": "kl_mask/frac", "tepo_measured": "kl_mask/penalty", "mpo": "ratio/max",
                  "clip_cov": "cov/n_selected", "kl_cov": "cov/n_selected", "cispo": "clip_ratio/high_mean",
                  "gmpo": "ratio/max", "sapo": "sapo/weight_mean"}


@pytest.mark.parametrize("case", list(TRL_OWN_METRIC))
def test_trl_engine_two_steps(case, trl_model):
    objective = case.removesuffix("_measured")
    extra = ["--entropy-criterion", "measured"] if case.endswith("_measured") else []   # rollout entropy
    out = f"runs/trl_{case}"
    run_main([*MICRO, "--engine", "trl", "--objective", objective, *extra, "--steps", "2", "--epochs", "2",
              "--save-every", "100", "--out", out])
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for row in rows[1:]:
        assert math.isfinite(row["loss"]) and math.isfinite(row["pg_loss"])
        assert math.isfinite(row[TRL_OWN_METRIC[case]])
        assert 0 <= row["accuracy/lenient"] <= 1 and "reward" in row and "entropy" in row
        assert 0 < row["on_policy"] < 1          # epoch 1's first mini-batch is on-policy, later ones not
    config = json.load(open(os.path.join(out, "config.json")))
    overrides = {"entropy_criterion": "measured"} if extra else {}
    assert config["engine"] == "trl"
    assert config["objective_config"] == dataclasses.asdict(tepo.config_for(objective, **overrides))
    assert os.path.exists(os.path.join(out, "policy", "config.json"))


def test_trl_engine_writes_completions_jsonl_as_the_loop_does(trl_model, capsys):
    """--engine trl's completions.jsonl: the rows of train_small.py's loop (tepokit/diagnostics/completions.py) on
    each logged step, from TRL's rollout. Each completion's rewards by name are the reward functions' on its text,
    its reward their weighted sum plus DAPO's length cost over its tokens, its group's rewards include it, the
    group's advantages are centred on its mean reward, and a cut completion counts --max-new-tokens tokens (its
    mask is 0 with --mask-truncated, so its length is read from the cut itself)."""
    from decimal import Decimal
    from tepokit.core.reward import weighted_rewards
    from tepokit.diagnostics.completions import COMPLETIONS_LOGGED, PROMPTS_LOGGED
    out = "runs/trl_completions"
    run_main([*MICRO, "--engine", "trl", "--objective", "dapo", "--steps", "2", "--log-completions-every", "1",
              "--reward", "lenient,format:0.5", "--mask-truncated", "--save-every", "100", "--out", out])
    rows = read_completions(out)
    assert [r["step"] for r in rows] == [1] * PROMPTS_LOGGED + [2] * PROMPTS_LOGGED
    said = capsys.readouterr().out                       # the end of the run shows the last step's first prompt
    assert "  completions          step 2, its first prompt (completions.jsonl): " in said
    for row in rows:
        assert len(row["group_rewards"]) == 4 and len(row["completions"]) == min(4, COMPLETIONS_LOGGED)
        assert row["prompt"] and row["gold"]
        for c, in_group in zip(row["completions"], row["group_rewards"]):
            _, parts = weighted_rewards([c["text"]], [Decimal(row["gold"])], "lenient,format:0.5")
            assert c["rewards"] == {name: values[0].item() for name, values in parts.items()}
            length_cost = tepo.soft_overlong_punishment(torch.tensor([float(c["tokens"])]), 12, 4).item()
            assert c["reward"] == pytest.approx(c["rewards"]["lenient"] + 0.5 * c["rewards"]["format"] + length_cost)
            assert c["reward"] == pytest.approx(in_group)
            assert 1 <= c["tokens"] <= 12 and (c["tokens"] == 12 or not c["cut"])     # a cut row: all 12
        advantages = [c["advantage"] for c in row["completions"]]
        mean = sum(row["group_rewards"]) / 4
        assert sum(advantages) == pytest.approx(0, abs=1e-4)
        assert all((a > 0) == (r > mean + 1e-9) for a, r in zip(advantages, row["group_rewards"]) if abs(a) > 1e-6)


def test_trl_engine_warns_when_a_run_cannot_learn_as_the_loop_does(trl_model, capsys):
    """--max-new-tokens 2: most completions are cut, and none has a `#### n`: both warnings of the built-in engine
    fire at step STREAK, once, in one line each, and metrics.jsonl records them on that step."""
    from tepokit.diagnostics.completions import STREAK
    run_main([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", str(STREAK + 1), "--max-new-tokens", "2",
              "--overlong-cache", "1", "--reward", "strict", "--save-every", "100", "--out", "runs/trl_cut"])
    rows = read_rows("runs/trl_cut")
    assert all(r["completions/clipped_ratio"] > 0.5 for r in rows[1:])
    assert warnings_of(rows) == {STREAK: ["no_signal", "truncation"]}
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning: " in line]
    assert len(lines) == 2 and lines[0].startswith(f"warning: step {STREAK}: more than half the completions were cut")


def test_trl_warnings_go_on_from_a_resumed_runs_history(capsys):
    """A resumed run's history (its checkpoint's trainer state) is replayed without a word: its streak goes on, and
    the warning fires on the step an uninterrupted run's does; TRL's rows without a rollout are not read."""
    from types import SimpleNamespace
    from tepokit.diagnostics.completions import STREAK
    from tepokit.tools.tepo_trl import CannotLearnWarnings
    args, _ = parse_args(ts.Args, MICRO)
    cut = {"reward": 0.0, "completions/clipped_ratio": 1.0, "frac_reward_zero_std": 0.0}
    history = [{**cut, "step": 2 * step} for step in range(1, STREAK)] + [{"loss": 0.1, "step": 2 * STREAK - 1}]
    state = SimpleNamespace(log_history=history, is_world_process_zero=True, global_step=2 * STREAK)
    callback = CannotLearnWarnings(args, optimizer_steps=2)
    callback.on_train_begin(None, state, None)
    assert capsys.readouterr().out == ""
    state.log_history.append({**cut, "step": 2 * STREAK})              # as Trainer.log keeps it, before on_log
    callback.on_log(None, state, None, logs=cut)
    assert state.log_history[-1]["warning/truncation"] == 1.0 and "warning/no_signal" not in state.log_history[-1]
    assert capsys.readouterr().out.startswith(f"warning: step {STREAK}: more than half the completions were cut")


def test_trl_engine_bad_split_is_one_line(trl_model, capsys):
    """A rollout of 3 x 3 completions cannot make 2 mini-batches: exit 2, one line, nothing written.
    (With 2 prompts, 3 mini-batches are refused earlier, by the command line: a mini-batch holds whole groups.)"""
    with pytest.raises(SystemExit) as exc:
        ts.main([*MICRO, "--engine", "trl", "--prompts-per-step", "3", "--group-size", "3", "--mini-batches", "2",
                 "--out", "runs/trl_bad"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--mini-batches=2" in err and "divisor" in err
    assert not os.path.exists("runs/trl_bad")


@pytest.mark.parametrize("setting, message", [
    (dict(beta=0.0), "beta=0.0"),                       # grpo's beta 0.04 needs TRL's reference log-probs
    (dict(beta=0.04, entropy_coef=0.1), "entropy_coef=0.1"),   # a TRL loss switch tepo's loss would ignore
])
def test_trl_trainer_refuses_settings_it_would_ignore(setting, message, tmp_path):
    pytest.importorskip("trl")
    from tepokit.tools import tepo_trl
    from trl import GRPOConfig
    config = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", use_bias_correction_kl=False,
                        **setting)
    with pytest.raises(ValueError, match=re.escape(message)):
        tepo_trl.TepoGRPOTrainer(model="unused", reward_funcs=[], args=config, objective="grpo")


def test_trl_engine_stops_on_sigterm_with_a_checkpoint_and_resumes_every_step_once(trl_model):
    """SIGTERM to a real --engine trl run: TRL stops at the end of an RL step with a checkpoint, the log is
    written, one line says how to resume (exit 143); --resume goes on from TRL's checkpoint to the end with
    every step logged exactly once. A second run into the live directory is refused, naming the process."""
    out = "runs/trl_sigterm"
    process = start_process([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", "400", "--save-every",
                             "1000", "--out", out])
    wait_until(lambda: rows_in(out) >= 1, process)                       # step 0's evaluation: training starts
    assert_refused_in_one_line([*MICRO, "--engine", "trl", "--out", out, "--overwrite"],
                               f"in use by process {process.pid}")
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=300)[1]
    assert process.returncode == 143, stderr
    m = re.fullmatch(rf"train_small.py: SIGTERM: stopped after step (\d+), which is checkpointed; resume with: "
                     rf"python train_small.py --resume {out}", stderr.strip().splitlines()[-1])
    assert m and "Traceback" not in stderr, stderr
    stopped = int(m[1])
    assert 0 < stopped < 400 and [r["step"] for r in read_rows(out)] == list(range(stopped + 1))
    assert os.path.isdir(os.path.join(out, f"checkpoint-{2 * stopped}"))       # 2 optimizer steps per RL step
    run_main(["--resume", out, "--steps", str(stopped + 2)])                    # two more steps show it goes on
    rows = read_rows(out)
    assert [r["step"] for r in rows] == list(range(stopped + 3)) and "eval/accuracy" in rows[-1]


@pytest.fixture(scope="module")
def two_trl_checkpoints(trl_model):
    """An --engine trl run of 2 RL steps with a checkpoint after each (checkpoint-2 and checkpoint-4: 2 optimizer
    steps per RL step): its log and final policy are what a run resumed from checkpoint-2 must reproduce."""
    out = "runs/trl_two_checkpoints"
    run_main([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", "2", "--save-every", "1",
              "--log-completions-every", "1", "--out", out])
    return out, read_rows(out), Path(out, "policy", "model.safetensors").read_bytes()


def killed_while_saving(run_dir, out):
    """A copy of a finished run as a kill leaves it: metrics.jsonl holds step 0 only (--engine trl writes the
    rest at the end), no policy nor summary."""
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns(".lock", "policy", "summary.json"))
    first_row = Path(out, "metrics.jsonl").read_text().splitlines()[0]
    Path(out, "metrics.jsonl").write_text(first_row + "\n")


def cut_in_half(path):
    Path(path).write_bytes(Path(path).read_bytes()[:os.path.getsize(path) // 2])


# a checkpoint-4 whose save was interrupted: the file the Trainer was writing is missing or cut short
CHECKPOINT_CUT_OFF = {
    "optimizer.pt missing": (lambda d: os.remove(d / "optimizer.pt"), "optimizer.pt is missing"),
    "model.safetensors cut short": (lambda d: cut_in_half(d / "model.safetensors"), "model.safetensors is damaged ("),
}


@pytest.mark.parametrize("damage", list(CHECKPOINT_CUT_OFF))
def test_trl_resume_falls_back_to_the_newest_whole_checkpoint(damage, two_trl_checkpoints, capsys):
    """--resume skips the incomplete newest checkpoint in one line naming both, sets it aside (so the checkpoint-4
    the resumed run writes is whole) and computes step 2 again from checkpoint-2: the log (all steps) and the
    policy equal the uninterrupted run's. (Before, it refused the run or crashed in the Trainer.)"""
    run_dir, uninterrupted_rows, uninterrupted_policy = two_trl_checkpoints
    cut_off, phrase = CHECKPOINT_CUT_OFF[damage]
    out = f"runs/trl_cut_off_{damage.split()[0]}"
    killed_while_saving(run_dir, out)
    cut_off(Path(out, "checkpoint-4"))
    capsys.readouterr()
    run_main(["--resume", out])
    said = [line for line in capsys.readouterr().out.splitlines() if "incomplete" in line]
    assert len(said) == 1, said
    m = re.fullmatch(r"checkpoint-4 is incomplete \((.*)\), set aside as incomplete-checkpoint-4; resuming from "
                     r"checkpoint-2, RL step 1", said[0])
    assert m and m[1].startswith(phrase), said[0]
    assert without_timing(read_rows(out)) == without_timing(uninterrupted_rows)
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2]
    assert Path(out, "policy", "model.safetensors").read_bytes() == uninterrupted_policy
    # step 2's completions, logged before the kill, were dropped and logged again: each step's rows once
    assert Path(out, "completions.jsonl").read_text() == Path(run_dir, "completions.jsonl").read_text()
    assert [row["step"] for row in read_completions(out)] == [1, 1, 2, 2]
    assert resume.trl_checkpoint_problem(os.path.join(out, "checkpoint-4")) is None       # written again, whole
    assert resume.trl_checkpoint_problem(os.path.join(out, "incomplete-checkpoint-4")).startswith(phrase)


def test_trl_resume_without_a_whole_checkpoint_is_one_line_and_changes_nothing(two_trl_checkpoints, capsys):
    run_dir, _, _ = two_trl_checkpoints
    out = "runs/trl_no_whole_checkpoint"
    killed_while_saving(run_dir, out)
    os.remove(os.path.join(out, "checkpoint-4", "identity.json"))
    cut_in_half(os.path.join(out, "checkpoint-2", "optimizer.pt"))
    before = {str(p): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ts.main(["--resume", out])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"train_small.py: error: argument --resume: no checkpoint-* directory of {out!r} is whole "
                   f"(checkpoint-4: identity.json is missing; checkpoint-2: optimizer.pt is damaged (BadZipFile: "
                   f"File is not a zip file)); start the run again with --out {out} --overwrite (nothing was changed)")
    assert {str(p): p.read_bytes() for p in sorted(Path(out).rglob("*")) if p.is_file()} == before


def test_trl_resume_of_a_run_checkpointed_at_its_last_step_is_refused_in_one_line(two_trl_checkpoints, capsys):
    """TRL's Trainer, resumed from its last step's checkpoint, trains one optimizer step more (and logged a
    half step): nothing is left to train, so --resume says how to extend the run instead, and changes nothing."""
    run_dir, rows, _ = two_trl_checkpoints
    before = {str(p): p.read_bytes() for p in sorted(Path(run_dir).rglob("*")) if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        ts.main(["--resume", run_dir])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"train_small.py: error: argument --resume: {run_dir} (--engine trl) is checkpointed at its last step, 2: "
        f"nothing is left to train; extend it with --resume {run_dir} --steps 3 or more (nothing was changed)")
    assert {str(p): p.read_bytes() for p in sorted(Path(run_dir).rglob("*"))
            if p.is_file() and p.name != ".lock"} == before


def test_trl_engine_honours_a_signal_during_its_final_save_after_the_summary(trl_model):
    """SIGTERM while --engine trl saves its final policy: the policy, the log and summary.json are written,
    then the run stops with 143 and says it is complete (the signal was once recorded and dropped)."""
    out = "runs/trl_final_signal"
    from tepokit.tools import tepo_trl
    with signal_at(tepo_trl.train, line_of(tepo_trl.train, "save_pretrained_atomically(trainer.model"), step=2), \
            pytest.raises(Stopped) as stop:
        ts.main([*MICRO, "--engine", "trl", "--objective", "grpo", "--steps", "2", "--save-every", "100",
                 "--out", out])
    assert stop.value.exit_status == 143
    assert stop.value.message == f"stopped after step 2, the last: the run is complete in {out}"
    assert [r["step"] for r in read_rows(out)] == [0, 1, 2] and "eval/accuracy" in read_rows(out)[-1]
    assert Path(out, "summary.json").exists() and Path(out, "policy", "model.safetensors").exists()


def test_trl_mpo_block_mean_counts_its_reference_kl_once_over_accumulated_micro_batches(trl_model, tmp_path):
    """MPO with block-mean aggregation and a reference KL, advantages at 0: the loss is beta times the KL
    alone, a token mean over the step. Over two accumulated micro-batches the adapter must give tepo's
    loss and gradient on the whole step (it once gave half of them: the KL divided by the accumulation twice)."""
    from trl.trainer.utils import split_tensor_dict
    cfg = tepo.config_for("mpo", beta=0.1, block_agg="block-mean")
    trainer = parity_trainer(trl_model, "mpo", cfg, {}, str(tmp_path))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trainer.train_dataset["prompt"]
                                                      for _ in range(4)])
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logp = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attn, T)[0]
    noise = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=noise)
    inputs["ref_per_token_logps"] = logp + 0.3 * torch.randn(logp.shape, generator=noise)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    total, grads, _ = one_accumulated_step(trainer, type(trainer)._compute_loss, split_tensor_dict(inputs, 2))
    model = copy.deepcopy(trainer.model)
    whole, _ = tepo.mpo_loss(trainer._get_per_token_logps_and_entropies(model, ids, attn, T)[0],
                             inputs["old_per_token_logps"], inputs["advantages"], inputs["completion_mask"], cfg,
                             ref_logp=inputs["ref_per_token_logps"])
    whole.backward()
    assert whole.item() > 1e-4 and total == pytest.approx(whole.item(), rel=1e-5)
    assert max((g - p.grad).abs().max().item() for g, p in zip(grads, model.parameters())) < 1e-6
