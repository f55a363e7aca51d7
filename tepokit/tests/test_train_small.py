"""train_small.py: the rollout, the RL step and the loop, end to end on micro configurations (CPU, no network)."""
import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import tempfile
import time

import pytest
import torch

import tepo
import train_small as ts
from tepokit.setup.model import build_char_tokenizer, build_tiny_model
from tepokit.diagnostics.stats import accuracy_auc
from tepokit.core.step_settings import step_settings
from tepokit.diagnostics.summary import accuracy_with_interval
from tepokit.core.taps import UpdateTaps
from tepokit.diagnostics.entropy_check import checked_rows
from tepokit.cli import flags as cli
from tepokit.tests.helpers import (F64, MICRO, REPO, assert_close, brute_force_pass_at_k, hand_batch, micro_run,
                                   old_policy_and_update, read_details, read_rows, run_main, start_process,
                                   without_timing)


def test_end_token_is_in_loss_mask_when_pad_equals_eos():
    eos = 0   # pad id == eos id: generate pads the rows that stopped early with the end token
    ids = torch.tensor([[5, 6, eos, eos, eos],     # stopped: the first end token is trained
                        [5, 6, 7, 8, 9],           # truncated: no end token
                        [eos, eos, eos, eos, eos]])  # stopped at once: the end token is its only token
    mask = ts.completion_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_the_samplers_logprobs_twin_equals_the_recomputed_old_logprobs():
    """Left padding (prompts of different lengths), pad == eos, temperature != 1: the sampler's log-probs
    and entropies equal a recomputation; with either as the old log-probs, the first mini-batch is
    exactly on-policy and ends with the same old log-probs. The entropy check's logits before the update (the
    update's taps, tepokit/core/taps.py) are the rollout policy's forward on the checked rows, whichever the old
    log-probs: the sampler's log-probs read from them agree with the sampler's own."""
    torch.manual_seed(0)
    args = ts.Args(n_layer=2, n_embd=32, n_head=2, temperature=0.7, max_new_tokens=10, mini_batches=2, group_size=2)
    tok = build_char_tokenizer(["abc 0123456789 Ann has a pen. How many?"])
    base = build_tiny_model(args, tok).eval()
    from transformers import GenerationConfig
    base.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    questions = ["Ann has 3 pens. How many?", "a?", "Ann has 12345 pens and 6789 more. How many?"]
    settings = step_settings(args, base.config)
    batch = ts.generate_group(base, tok, questions, 2, args, torch.device("cpu"), want_logprobs=True)
    assert (batch.prompt_mask == 0).any()       # some rows really are left-padded
    adv = torch.randn(6)
    keep = torch.ones(6, dtype=torch.bool)
    plan = ts.minibatch_plan(keep, args, settings.rows_per_forward)
    sampler = {key: getattr(batch, key).clone() for key in ("sampling_logp", "sampling_entropy")}
    c = checked_rows(args.entropy_check_rows, 6, args.max_new_tokens)
    results = {}
    for recompute in (True, False):
        run = micro_run(copy.deepcopy(base), tok, args, "grpo", recompute=recompute, beta=0.0)
        taps = UpdateTaps(settings=run.settings, logits_rows=c)
        metrics, seen, _, _ = old_policy_and_update(run, batch, adv, plan, observe=taps)
        results[recompute] = seen, metrics, taps.logits_before, run.model
    (recomputed, m_recomputed, before_r, model_r), (sampled, m_sampled, before_s, _) = results[True], results[False]
    mask = batch.completion_mask.bool()
    for key, values in sampler.items():          # the rollout's record stays the sampler's (not an alias of the
        assert torch.equal(getattr(batch, key), values)   # old log-probs, which the first mini-batch replaces)
    assert (batch.sampling_logp - recomputed.logp).abs()[mask].max().item() < 1e-5
    assert (batch.sampling_entropy - recomputed.entropy).abs()[mask].max().item() < 1e-5
    # the entropy check's logits before the update: the rollout policy's forward over the first c rows, as the
    # check's forward after the update makes them, on either path; the sampler drew from them (to rounding)
    rows = torch.arange(c)
    with torch.no_grad():
        policy = torch.cat([ts.completion_logits(base, batch, r, settings.precision, settings.prompt_once)
                            for r in rows.split(settings.rows_per_forward)])                      # [c, T, V]
        after = ts.completion_logits(model_r, batch, rows, settings.precision, settings.prompt_once)
    assert before_r.shape == before_s.shape == (c, batch.completion_ids.shape[1], policy.shape[-1])
    assert torch.equal(before_r, policy) and torch.equal(before_s, policy)
    assert (after - before_r).abs()[mask[:c]].max() > 1e-4                      # the update did move them
    from_before = ts.token_logprobs(before_s, batch.completion_ids[:c], args.temperature)
    assert (from_before - batch.sampling_logp[:c]).abs()[mask[:c]].max().item() < 1e-5
    # recomputed: the update's first mini-batch sees ratio exactly 1 (same rows, same forward) ...
    assert m_recomputed["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0
    # ... sampled: it measures the sampler's distance from the forward, then takes the forward's own values
    assert 0.0 < m_sampled["logprobs/first_minibatch_max_abs_log_ratio"] < 1e-5
    first = torch.cat(plan[0])
    assert torch.equal(sampled.logp[first], recomputed.logp[first])
    assert m_sampled["on_policy"] == m_recomputed["on_policy"] == 0.5   # of two optimizer steps, the first
    assert m_sampled["loss"] == pytest.approx(m_recomputed["loss"], rel=1e-4, abs=1e-7)


def test_the_entropy_check_compares_the_taps_logits_before_the_update_with_a_forward_after_it():
    """The entropy check (tepokit/diagnostics/entropy_check.py) from the update's taps: logits_before is the rollout
    policy's forward over the first c rows before the first optimizer step; entropy_check's numbers are
    tepo.entropy_change_prediction's at the valid positions of those rows between it and a forward after the update
    (float64, to 1e-12), and its measured change is H(after) - H(before) there."""
    from tepokit.diagnostics.entropy_check import entropy_check
    from tepokit.diagnostics.stats import pearson
    base = float64_gpt2(vocab=23)
    batch = hand_batch(23, rows=16, prompt=5, completion=6)
    adv = torch.randn(16, dtype=F64, generator=torch.Generator().manual_seed(4))
    args = ts.Args(group_size=4, prompts_per_step=4, mini_batches=2, micro_batch_size=4, max_new_tokens=6,
                   temperature=0.9, entropy_check_rows=6)
    run = micro_run(copy.deepcopy(base), None, args, "grpo", beta=0.0)
    run.optimizer = torch.optim.SGD(run.model.parameters(), lr=0.5)
    plan = ts.minibatch_plan(torch.ones(16, dtype=torch.bool), args, run.settings.rows_per_forward)
    c = checked_rows(args.entropy_check_rows, 16, args.max_new_tokens)
    taps = UpdateTaps(settings=run.settings, logits_rows=c)
    old_policy_and_update(run, batch, adv, plan, observe=taps)
    rows, settings = torch.arange(c), run.settings
    with torch.no_grad():
        before = ts.completion_logits(base, batch, rows, settings.precision, settings.prompt_once)       # [c, T, V]
        after = ts.completion_logits(run.model, batch, rows, settings.precision, settings.prompt_once)
    assert c == 6 and taps.logits_before.dtype == F64
    assert_close(taps.logits_before, before, atol=1e-12, rtol=0)
    valid = batch.completion_mask[:c].bool()
    predicted, measured = tepo.entropy_change_prediction(before[valid], after[valid], args.temperature)   # [n] each
    assert_close(measured, tepo.entropy_from_logits(after[valid], args.temperature)
                 - tepo.entropy_from_logits(before[valid], args.temperature), atol=1e-12)
    assert measured.abs().max() > 1e-4                                             # the update did change them
    check = entropy_check(run.model, batch, taps.logits_before, settings)
    assert check["entropy_change/predicted"] == pytest.approx(predicted.mean().item(), rel=1e-9, abs=1e-12)
    assert check["entropy_change/measured"] == pytest.approx(measured.mean().item(), rel=1e-9, abs=1e-12)
    assert check["entropy_change/position_corr"] == pytest.approx(pearson(predicted.tolist(), measured.tolist()),
                                                                  rel=1e-9)


EPOCH_QUESTIONS = ["Ann has 3 pens. How many?", "a?", "Bob has 12 cups and 7 more. How many cups?", "Cal: 5 - 2?",
                   "Dee has 4 bags of 6 eggs. How many eggs?", "9?", "Eve has 11 coins, gives 3. How many?", "2+2?"]


@pytest.mark.parametrize("objective, overrides", [
    ("grpo", dict(beta=0.0)), ("tepo", dict(entropy_criterion="measured", eps_low=0.05, eps_high=0.05))])
def test_the_fast_twins_make_the_plain_paths_update_over_epochs_and_micro_batches(objective, overrides):
    """2 epochs x 4 mini-batches of 2 groups of 3 rows, micro-batches of 4 rows (a group split across two),
    float64: the fast twins (the sampler's old log-probs and entropies, the forward that reads each prompt once)
    make the same 8 optimizer steps as the plain path (--no-fast: old log-probs by a no-grad forward, one forward
    of prompt + completion per row).

    The first mini-batch's rows take the policy's own forward (micro_batch_loss), and epoch 2 must reuse
    those values. In float64 the sampler already equals the forward to ~1e-15, so neither a dropped nor a
    misplaced replacement would show; the sampler's values of exactly those rows are therefore made wrong on
    purpose (noise of std 0.02, valid tokens only) while every other row keeps its exact sampler values.
    Correct code never trains on the noise: it is measured by the first mini-batch's log-ratio and then gone."""
    args = ts.Args(n_layer=1, n_embd=16, n_head=2, temperature=0.9, max_new_tokens=8, prompts_per_step=8,
                   group_size=3, mini_batches=4, epochs=2, micro_batch_size=4)
    tok = build_char_tokenizer(EPOCH_QUESTIONS + ["0123456789 #"])
    torch.manual_seed(0)
    base = build_tiny_model(args, tok).double().eval()
    from transformers import GenerationConfig
    base.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    batch = ts.generate_group(base, tok, EPOCH_QUESTIONS, 3, args, torch.device("cpu"), want_logprobs=True)
    assert batch.sampling_logp.dtype == F64 and (batch.prompt_mask == 0).any()
    rows = batch.completion_ids.shape[0]                                       # 24
    adv = torch.randn(rows, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    plan = ts.minibatch_plan(torch.ones(rows, dtype=torch.bool), args,              # drawn once, used by both
                             step_settings(args, base.config).rows_per_forward)
    assert [[len(micro) for micro in minibatch] for minibatch in plan] == [[4, 2]] * 8
    first_minibatch = torch.zeros(rows, dtype=torch.bool)
    first_minibatch[torch.cat(plan[0])] = True
    made_wrong = batch.completion_mask.bool() & first_minibatch[:, None]         # [B, T]
    noise = 0.02 * torch.randn(made_wrong.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    noise = noise * made_wrong
    batch.sampling_logp = batch.sampling_logp + noise
    batch.sampling_entropy = batch.sampling_entropy + noise
    results = {}
    for recompute in (True, False):       # True: the plain path; False: the fast twins
        model = copy.deepcopy(base)
        run = micro_run(model, tok, dataclasses.replace(args, fast=not recompute), objective, recompute=recompute,
                        **overrides)
        run.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)   # a step proportional to the gradient
        metrics, seen, _, _ = old_policy_and_update(run, batch, adv, plan)
        results[recompute] = torch.cat([p.detach().flatten() for p in model.parameters()]), metrics, seen
    (p_recomputed, m_recomputed, recomputed), (p_sampled, m_sampled, sampled) = results[True], results[False]
    start = torch.cat([p.flatten() for p in base.parameters()])
    assert (p_recomputed - start).abs().max() > 0.05                              # the 8 steps did move it
    assert_close(p_sampled, p_recomputed, atol=1e-9, rtol=0)
    valid = batch.completion_mask.bool()
    assert_close(sampled.logp[valid], recomputed.logp[valid], atol=1e-12, rtol=0)   # kept, replaced
    if tepo.needs_entropy(objective, run.cfg):         # TEPO's measured criterion: old entropies likewise
        assert_close(sampled.entropy[valid], recomputed.entropy[valid], atol=1e-12, rtol=0)
    for key, value in m_recomputed.items():
        if not key.startswith("logprobs/first_minibatch"):
            assert m_sampled[key] == pytest.approx(value, abs=1e-9), key
    assert m_recomputed["clip_ratio/region_mean"] > 0.1 and m_recomputed["on_policy"] == 1 / 8   # clipping acts
    # what the first micro-batch measured before the replacement: the noise itself (0 when recomputed)
    first_noise = noise[plan[0][0]].abs()[made_wrong[plan[0][0]]]
    assert m_sampled["logprobs/first_minibatch_max_abs_log_ratio"] == pytest.approx(first_noise.max().item(), abs=1e-9)
    assert m_recomputed["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0


@pytest.mark.parametrize("objective", sorted(tepo.OBJECTIVES))
def test_two_steps_of_every_objective(objective, workdir):
    out = f"runs/e2e_{objective}"
    run_main([*MICRO, "--objective", objective, "--steps", "2", "--out", out])
    rows = read_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["args"]["objective"] == objective
    assert config["needs_ref"] == tepo.needs_ref(objective, tepo.config_for(objective))
    for r in rows[1:]:
        for key in ("reward", "reward_std", "accuracy/strict", "accuracy/lenient", "frac_reward_zero_std",
                    "completions/mean_length", "completions/clipped_ratio", "entropy", "cov/logp_adv",
                    "entropy_change/predicted", "entropy_change/measured", "timing/generate", "step_time"):
            assert key in r and r[key] == r[key], (key, r)          # present and not NaN
        assert 0 <= r["entropy"] <= torch.log(torch.tensor(200.0)).item()
        if not r["dynamic_sampling/skipped"]:
            # the sampler's log-probs are the old ones (fp32): the first mini-batch's forward agrees with them
            assert r["logprobs/first_minibatch_max_abs_log_ratio"] < 1e-5
            assert "logprobs/sampling_vs_recomputed_max_abs" not in r
            assert "clip_ratio/region_mean" in r and "grad_norm" in r
        if objective == "tepo" and not r["dynamic_sampling/skipped"]:
            assert "kl_mask/frac" in r
    assert "eval/accuracy" in rows[-1] and "eval/pass@2" in rows[-1]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["final_accuracy"] == rows[-1]["eval/accuracy"]
    assert os.path.exists(os.path.join(out, "checkpoint.pt"))


def test_some_micro_step_really_updates_and_the_plain_path_agrees_to_rounding(workdir):
    """The micro warm-up gives mixed rewards, so the update path (not just the skip) is exercised. The same run
    on the plain path (--no-fast: model.generate, one forward per row, old log-probs by a forward) draws the same
    completions and trains the same to rounding."""
    command = [*MICRO, "--objective", "grpo", "--steps", "3", "--no-dynamic-sampling"]
    run_main([*command, "--out", "runs/e2e_update"])
    run_main([*command, "--no-fast", "--out", "runs/e2e_update_plain"])
    rows, plain = read_rows("runs/e2e_update")[1:], read_rows("runs/e2e_update_plain")[1:]
    assert any(r["reward_std"] > 0 for r in rows)
    assert all("loss" in r for r in rows)
    assert any(r["on_policy"] < 1 for r in rows)   # 2 mini-batches: after a real update the second is off-policy
    for fast, slow in zip(rows, plain):
        assert fast["reward"] == slow["reward"] and fast["completions/mean_length"] == slow["completions/mean_length"]
        for key in ("loss", "entropy", "cov/logp_adv", "grad_norm"):
            assert slow[key] == pytest.approx(fast[key], rel=1e-4, abs=1e-6), key
        assert slow["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0     # recomputed: exactly on-policy
        assert 0.0 < fast["logprobs/first_minibatch_max_abs_log_ratio"] < 1e-5   # the sampler's, to rounding


def test_resume_reproduces_the_uninterrupted_run(workdir):
    args = [*MICRO, "--objective", "tepo", "--steps", "4", "--eps-low", "0.05", "--eps-high", "0.05"]
    run_main([*args, "--out", "runs/full"])
    run_main([*args, "--out", "runs/cut", "--stop-after", "2"])
    assert not os.path.exists("runs/cut/summary.json")
    run_main(["--resume", "runs/cut"])
    full, resumed = without_timing(read_rows("runs/full")), without_timing(read_rows("runs/cut"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    assert resumed == full
    # details.jsonl (TEPO): truncated on resume like metrics.jsonl, then the same rows, floats exactly
    assert [r["step"] for r in read_details("runs/cut")] == [1, 2, 3, 4]
    assert read_details("runs/cut") == read_details("runs/full")


def float64_gpt2(vocab: int):
    """A one-layer GPT-2 of width 16 in float64, dropout off, its weights drawn under seed 0."""
    from transformers import AutoModelForCausalLM, GPT2Config
    config = GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().eval()


@pytest.mark.parametrize("objective, overrides", [
    ("grpo", dict(beta=0.04)), ("dapo", {}), ("dr_grpo", {}), ("gspo", dict(eps_low=0.05, eps_high=0.05)),
    ("gspo_token", {}), ("ppo", dict(dual_clip_c=3.0)), ("mpo", {}),
    ("tepo", dict(entropy_criterion="measured", eps_low=0.05, eps_high=0.05)), ("cispo", {}),
    ("gmpo", dict(eps_low=0.05, eps_high=0.05)), ("sapo", {})])
def test_micro_batches_accumulate_to_the_same_optimizer_steps(objective, overrides):
    """Two optimizer steps (mini-batches of 8 rows) with micro-batches of 2 rows equal the steps
    without micro-batches: parameters to 1e-6 (float64, plain SGD), losses and rollout statistics too.
    (Clip-Cov, KL-Cov and TEPO's cov criterion select by batch statistics per micro-batch.)"""
    base = float64_gpt2(vocab=23)
    batch = hand_batch(23, rows=16, prompt=5, completion=6)
    adv = torch.randn(16, dtype=F64)
    keep = torch.ones(16, dtype=torch.bool)
    results = []
    for micro in (0, 2):
        model = copy.deepcopy(base)
        needs_ref = tepo.needs_ref(objective, tepo.config_for(objective, **overrides))
        ref = copy.deepcopy(base).requires_grad_(False) if needs_ref else None
        args = ts.Args(group_size=4, prompts_per_step=4, mini_batches=2, micro_batch_size=micro, max_new_tokens=6,
                       entropy_check_rows=4, temperature=0.9)
        run = micro_run(model, None, args, objective, ref_model=ref, **overrides)
        run.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)   # unlike Adam, sensitive to the gradient's scale
        torch.manual_seed(1)
        plan = ts.minibatch_plan(keep, args, run.settings.rows_per_forward)
        assert [len(mb) for mb in plan] == ([1, 1] if micro == 0 else [4, 4])
        metrics, seen, _, _ = old_policy_and_update(run, batch, adv, plan)
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), metrics, seen))
    (p0, m0, s0), (p2, m2, s2) = results
    assert_close(p2, p0, atol=1e-6, rtol=0)
    assert (p2 - torch.cat([p.flatten() for p in base.parameters()])).abs().max() > 1e-4   # it did move
    assert_close(s2.logp, s0.logp, atol=1e-12)
    for key in ("loss", "pg_loss", "kl_loss", "ratio/min", "ratio/max", "grad_norm"):
        assert m2[key] == pytest.approx(m0[key], abs=1e-9), key


@pytest.mark.parametrize("objective", ["tepo", "grpo", "gspo", "mpo"])
def test_the_whole_loop_runs_in_bf16_on_the_cpu(objective, workdir):
    """--precision bf16 (CPU autocast): the loop runs, the first mini-batch is still exactly
    on-policy (same rows, same forward), and the logged noise floor of bf16 is above 0."""
    run_main([*MICRO, "--objective", objective, "--steps", "2", "--precision", "bf16",
              "--out", f"runs/bf16_{objective}"])
    rows = read_rows(f"runs/bf16_{objective}")[1:]
    updated = [r for r in rows if not r["dynamic_sampling/skipped"]]    # DAPO's filter may skip a step
    assert updated and all(math.isfinite(r["loss"]) for r in updated)
    assert all(r["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0 for r in updated)
    assert all(r["precision/logp_error_max"] > 1e-4 for r in rows)
    assert all(r["precision/logp_error_mean"] <= r["precision/logp_error_max"] for r in rows)
    fp32 = read_rows("runs/full")[1] if os.path.exists("runs/full") else None
    if fp32 is not None:
        assert fp32["precision/logp_error_max"] == 0.0


def test_entropy_check_every_n_steps_changes_nothing_else(workdir):
    run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--out", "runs/check_every_1", "--no-dynamic-sampling"])
    run_main([*MICRO, "--objective", "grpo", "--steps", "3", "--out", "runs/check_every_2", "--no-dynamic-sampling",
              "--entropy-check-every", "2"])
    every, second = read_rows("runs/check_every_1"), read_rows("runs/check_every_2")
    checked = [r["step"] for r in second if "entropy_change/predicted" in r]
    assert checked == [2]
    check_keys = ("entropy_change/",)
    assert [{k: v for k, v in r.items() if not k.startswith(check_keys)} for r in without_timing(second)] == \
        [{k: v for k, v in r.items() if not k.startswith(check_keys)} for r in without_timing(every)]
    assert second[2]["entropy_change/measured"] == every[2]["entropy_change/measured"]


def test_evaluate_reports_pass_at_k_of_each_problems_samples(monkeypatch):
    """evaluate with generation replaced by a known pattern: problem i's greedy answer is right when
    i is even, and c_i = i % 5 of its K = 4 samples are right; chunks of 6 rows cut across problems."""
    import datasets
    problems, k = 11, 4
    test = datasets.Dataset.from_list([{"question": f"q{i}", "answer": f"#### {i}"} for i in range(problems)])

    def generate(model, tokenizer, questions, group_size, args, device, greedy=False):
        return {"questions": questions, "group_size": group_size, "greedy": greedy}

    def decode(tokenizer, batch):
        texts = []
        for q in batch["questions"]:
            i = int(q[1:])
            for j in range(batch["group_size"]):
                right = i % 2 == 0 if batch["greedy"] else j < i % 5
                texts.append(f"#### {i}" if right else "#### 999")
        return texts

    monkeypatch.setattr(ts, "generate_group", generate)
    monkeypatch.setattr(ts, "decode", decode)
    args = ts.Args(pass_k=k, pass_k_problems=9, prompts_per_step=3, group_size=2)
    got = ts.evaluate(None, None, test, args, torch.device("cpu"))
    assert got["eval/accuracy"] == pytest.approx(6 / 11)
    counts = [i % 5 for i in range(9)]
    for kk in (1, 2, 4):
        expected = sum(brute_force_pass_at_k(k, c, kk) for c in counts) / 9
        assert got[f"eval/pass@{kk}"] == pytest.approx(expected)
    assert got["eval/mean@4"] == pytest.approx(sum(counts) / 36) == got["eval/pass@1"]


def test_run_summary_has_the_auc_and_every_pass_at_k(workdir):
    out = "runs/cmp/tepo__1"                     # written by the compare test above, or made here
    if not os.path.exists(os.path.join(out, "summary.json")):
        run_main([*MICRO, "--objective", "tepo", "--steps", "2", "--out", out])
    summary = json.load(open(os.path.join(out, "summary.json")))
    evals = [r for r in read_rows(out) if "eval/accuracy" in r]
    assert summary["accuracy_auc"] == pytest.approx(accuracy_auc([r["step"] for r in evals],
                                                                     [r["eval/accuracy"] for r in evals]))
    for row in evals:                            # K = 2: pass@1 is mean@2, and pass@2 >= pass@1
        assert row["eval/pass@1"] == pytest.approx(row["eval/mean@2"]) and row["eval/pass@2"] >= row["eval/pass@1"]
    assert (summary["final_pass@1"], summary["final_pass@2"]) == (evals[-1]["eval/pass@1"], evals[-1]["eval/pass@2"])


def test_evaluations_and_the_result_stay_on_screen_and_a_resumed_bar_counts_from_its_step(workdir, capsys):
    """Each held-out evaluation prints a lasting line (not only the progress bar's postfix), the run ends
    with a summary block (accuracy with its interval, entropy, KL mask, files, next commands), and a
    resumed run's progress bar starts at the resumed step."""
    run_main([*MICRO, "--objective", "tepo", "--steps", "2", "--out", "runs/screen"])
    out = capsys.readouterr().out
    interval = r"\d\.\d{3} (\+- \d\.\d{3}|\([<>]= \d\.\d{3}\))"   # a value and its 95% interval's half-width or bound
    assert re.search(rf"^step    0: held-out accuracy {interval}, pass@2 {interval} \(the start model; \+- : 95% "
                     r"intervals over 4 and 2 problems\)$", out, re.M)
    e1, e2 = [r["entropy"] for r in read_rows("runs/screen")[1:]]       # 2 steps: the first and the last step
    assert re.search(rf"^step    2: held-out accuracy {interval}, pass@2 {interval}, entropy {(e1 + e2) / 2:.3f} "
                     r"\(mean of steps 1-2\)$", out, re.M)
    block = out[out.index("done: tepo, seed 1, 2 RL steps in"):]
    summary = json.load(open("runs/screen/summary.json"))
    assert f"{accuracy_with_interval(summary['start_accuracy'], 4)} -> " in block
    assert "95% intervals over 4 problems" in block
    assert "(2 samples of each of 2 problems)" in block          # what the sampled accuracy was measured on
    assert f"token entropy        {e1:.3f} -> {e2:.3f} nats ({100 * (e2 / e1 - 1):+.0f}%; first and last step)" \
        in block
    for label in ("held-out accuracy", "sampled (T=1)", "token entropy", "KL mask (TEPO)", "files", "next"):
        assert f"\n  {label}" in block, label
    assert "python -m tepokit.tools.plot runs/screen" in block
    run_main(["--resume", "runs/screen", "--steps", "3"])
    err = capsys.readouterr().err
    assert re.search(r"tepo seed 1:\s+67%\|[^|]*\| 2/3", err) and not re.search(r"tepo seed 1:\s+0%", err), err[-500:]


@pytest.mark.parametrize("objective, overrides", [("grpo", dict(beta=0.0)), ("tepo", {})])
def test_entropy_coef_adds_the_bonus_to_the_objectives_loss_and_gradient(objective, overrides):
    """--entropy-coef c: the micro-batch loss is the objective's plus tepo.entropy_bonus of the same logits
    (value to 1e-12 in float64); the gradient changes by the bonus's own gradient."""
    model = float64_gpt2(vocab=23)
    batch = hand_batch(23, rows=8, prompt=5, completion=6)
    adv = torch.randn(8, dtype=F64)
    args = ts.Args(group_size=4, prompts_per_step=2, mini_batches=1, max_new_tokens=6, temperature=0.9)
    rows = torch.arange(8)
    losses, grads = [], []
    for coef in (0.0, 0.7):
        run = micro_run(model, None, args, objective, entropy_coef=coef, **overrides)
        plan = ts.minibatch_plan(torch.ones(8, dtype=torch.bool), args, run.settings.rows_per_forward)
        old = ts.old_policy(run, batch, plan)
        counts = dict(num_tokens=batch.completion_mask.sum().item(), num_seqs=8.0)
        model.zero_grad(set_to_none=True)
        loss, _, _, _ = ts.micro_batch_loss(run, batch, old, adv, rows, counts)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    run.cfg = tepo.config_for(objective, entropy_coef=0.7, **overrides)
    from tepokit.core.forward import completion_logits
    model.zero_grad(set_to_none=True)
    logits = completion_logits(model, batch, rows, run.settings.precision, run.settings.prompt_once)
    bonus = tepo.entropy_bonus(logits, batch.completion_mask, run.cfg, args.temperature, **counts)
    bonus.backward()
    assert bonus.item() < 0
    assert_close(losses[1], losses[0] + bonus.detach(), atol=1e-12)
    assert_close(grads[1], grads[0] + torch.cat([p.grad.flatten() for p in model.parameters()]), atol=1e-10)


def test_hidden_type_task_logs_its_forks_and_summarises_the_collapse(workdir):
    """A micro run of --task hidden-type: every step logs the decision-token metrics, every evaluation the
    results of each type, and summary.json the decision-token entropy at the start and end."""
    out = "runs/e2e_hidden_type"
    run_main([*MICRO, "--task", "hidden-type", "--difficulty", "3", "--n-train", "60", "--objective", "grpo",
              "--steps", "2", "--pass-k", "2", "--out", out])
    rows = read_rows(out)
    assert json.load(open(os.path.join(out, "config.json")))["args"]["task"] == "hidden-type"
    for r in rows[1:]:
        for key in ("forks/entropy", "forks/entropy_rest", "forks/strategies_per_group", "forks/majority_share",
                    "entropy/top20", "format/valid"):
            assert key in r, key
        assert 1 <= r["forks/strategies_per_group"] <= 2 or math.isnan(r["forks/entropy"])
    for key in ("eval/accuracy/add", "eval/pass@2/add", "eval/format"):
        assert key in rows[0] and key in rows[-1], key
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert {"decision_entropy_start", "decision_entropy_end", "start_pass@2/add", "final_pass@2/add",
            "format_eval_min", "format_rollout_min", "format_rollout_mean"} <= set(summary)
    # each start_/final_ key is an evaluation key, whole: final_pass@2/add from eval/pass@2/add
    evaluated = {k[len("eval/"):] for k in rows[-1] if k.startswith("eval/")}
    for key in summary:
        if key.startswith(("start_", "final_")) and "/" in key:
            assert key.split("_", 1)[1] in evaluated, key


def test_the_cue_variant_logs_how_often_the_policy_follows_the_cue(workdir):
    """--task hidden-type --cue 0.9: every step logs forks/cue_share, every evaluation eval/cue_share, both
    shares in [0, 1]; and the problems 2 and 2 are counted apart."""
    out = "runs/e2e_cue"
    run_main([*MICRO, "--task", "hidden-type", "--cue", "0.9", "--difficulty", "3", "--n-train", "60",
              "--objective", "grpo", "--steps", "2", "--pass-k", "2", "--out", out])
    rows = read_rows(out)
    assert all(0 <= r["forks/cue_share"] <= 1 for r in rows[1:])
    assert all(0 <= r["eval/cue_share"] <= 1 and r["eval/solved_by_either"] >= 0 for r in (rows[0], rows[-1]))
    assert json.load(open(os.path.join(out, "config.json")))["args"]["cue"] == 0.9
    # which completions the clip took out of the second optimizer step (band.py): one group of 4, so at most 4 rows
    for r in rows[1:]:
        counted = {k: v for k, v in r.items() if k.startswith("band/")}
        assert len(counted) == 24 and sum(v for k, v in counted.items() if k.endswith("/rows")) <= 4
        assert all(counted[k.replace("/rows", "/clipped")] <= v for k, v in counted.items() if k.endswith("/rows"))


def test_a_run_records_when_it_started_and_finished_and_the_code_that_ran(workdir):
    """config.json: started_at and the code (git commit, uncommitted changes) at the start; summary.json: the same
    start, finished_at and the code at the end. --compare reading the run back keeps its finish, not its own time."""
    out = "runs/stamped"
    run_main([*MICRO, "--objective", "grpo", "--optimizer", "sgd", "--lr", "0.1", "--steps", "1", "--out", out])
    config, summary = (json.load(open(os.path.join(out, name))) for name in ("config.json", "summary.json"))
    assert summary["started_at"] == config["started_at"] <= summary["finished_at"]
    assert time.strptime(summary["finished_at"], "%Y-%m-%dT%H:%M:%SZ")
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert config["code"]["commit"] == summary["code"]["commit"] == (head or None)
    assert config["args"]["optimizer"] == "sgd"
    summary["finished_at"] = "2000-01-01T00:00:00Z"        # as if written long ago: a read back keeps it
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f)
    os.makedirs("runs/cmp_stamped", exist_ok=True)
    os.rename(out, "runs/cmp_stamped/grpo__1")
    run_main([*MICRO, "--optimizer", "sgd", "--lr", "0.1", "--steps", "1", "--compare", "grpo", "--seeds", "1",
              "--out", "runs/cmp_stamped"])
    assert json.load(open("runs/cmp_stamped/grpo__1/summary.json"))["finished_at"] == "2000-01-01T00:00:00Z"


def test_sgd_makes_plain_steps_of_lr_times_the_clipped_gradient():
    """--optimizer sgd: torch's SGD without momentum, so an optimizer step moves every parameter by -lr x its
    gradient after clipping (checked on one step of a micro run)."""
    args, overrides = cli.parse_args(ts.Args, [*MICRO, "--optimizer", "sgd", "--lr", "0.1", "--steps", "1",
                                                        "--out", os.path.join(tempfile.mkdtemp(), "r")])
    run = ts.start_run(args, overrides)
    assert type(run.optimizer) is torch.optim.SGD and run.optimizer.defaults["momentum"] == 0
    before, grads = [], []

    def observe(i, n, batch, micro_batches, model):
        before.append([p.detach().clone() for p in model.parameters()])
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))
        scale = min(1.0, run.args.max_grad_norm / (norm.item() + 1e-6))
        grads.append([p.grad.clone() * scale if p.grad is not None else None for p in model.parameters()])
    ts.rl_step(run, 1, observe=observe)
    lr = ts.learning_rate(1, run.args)
    assert before, "no optimizer step"
    after = before[1:] + [[p.detach() for p in run.model.parameters()]]
    for b, a, g in zip(before[-1:], after[-1:], grads[-1:]):
        for p_before, p_after, grad in zip(b, a, g):
            expected = p_before - lr * grad if grad is not None else p_before
            torch.testing.assert_close(p_after, expected, rtol=1e-5, atol=1e-7)


def test_two_runs_of_one_command_started_together_write_the_same_rows(tmp_path):
    """The same command and seed, twice at once on the default threads (each run's two threads then compete
    with the other's for the machine): the same metrics.jsonl, timings aside. Thread timing changed the
    order of the gradient's additions into each prompt (tepokit/core/forward.py, copy_rows) from step 1 on."""
    argv = ["--steps", "6", "--eval-every", "6", "--pass-k-problems", "20"]
    runs = [start_process([*argv, "--out", str(tmp_path / name)]) for name in ("a", "b")]
    for process in runs:
        assert process.wait(timeout=600) == 0, process.stderr.read()
    a, b = (without_timing(read_rows(tmp_path / name)) for name in ("a", "b"))
    assert [r["step"] for r in a] == list(range(7))
    for row_a, row_b in zip(a, b):
        assert row_a == row_b, {k: (v, row_b.get(k)) for k, v in row_a.items() if row_b.get(k) != v}


def test_intervals_count_the_problems_evaluated_not_n_test(workdir, capsys):
    """A 20-row data set holds out a fifth, 4 problems: every interval, the summary block and the logged counts
    say 4, not --n-test 16 nor --pass-k-problems 8."""
    with open("twenty.jsonl", "w") as f:
        f.writelines(json.dumps({"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"}) + "\n"
                     for i in range(20))
    run_main([*MICRO, "--dataset", "twenty.jsonl", "--n-test", "16", "--pass-k-problems", "8", "--steps", "2",
              "--out", "runs/twenty"])
    out = capsys.readouterr().out
    evals = [r for r in read_rows("runs/twenty") if "eval/accuracy" in r]
    assert [(r["eval/problems"], r["eval/pass_k_problems"]) for r in evals] == [(4, 4), (4, 4)]
    assert "(the start model; +- : 95% intervals over 4 and 4 problems)" in out
    assert "greedy; 95% intervals over 4 problems)" in out and "(2 samples of each of 4 problems)" in out
    assert "16 problems" not in out and "8 problems" not in out


@pytest.mark.parametrize("objective, overrides", [("dapo", {}), ("grpo", dict(beta=0.04)),
                                                  ("tepo", dict(aggregation="seq-mean-token-mean"))])
def test_mask_truncated_is_the_gradient_of_the_batch_without_the_cut_rows(objective, overrides):
    """--mask-truncated (DAPO's overlong filtering): the gradient with rows 1 and 6 cut equals the gradient of the
    same objective on the batch without them, in float64, for token-mean and sequence-mean aggregation; their
    advantages still came from the whole group. Off, the cut rows do count."""
    base = float64_gpt2(vocab=19)
    batch = hand_batch(19, rows=8, prompt=4, completion=5, seed=3)
    adv = torch.randn(8, dtype=F64, generator=torch.Generator().manual_seed(5))
    cut = torch.tensor([1, 6])
    batch.truncated[cut] = True
    kept = torch.tensor([i for i in range(8) if i not in cut.tolist()])
    without = ts.Rollout(prompt_ids=batch.prompt_ids[kept], prompt_mask=batch.prompt_mask[kept],
                         completion_ids=batch.completion_ids[kept], completion_mask=batch.completion_mask[kept],
                         truncated=batch.truncated[kept])

    def gradient(batch, adv, mask_truncated):
        args = ts.Args(group_size=2, prompts_per_step=len(adv) // 2, mini_batches=1, max_new_tokens=5,
                       mask_truncated=mask_truncated)
        run = micro_run(copy.deepcopy(base), None, args, objective, ref_model=copy.deepcopy(base), **overrides)
        grads = []
        plan = [[torch.arange(len(adv))]]
        old_policy_and_update(run, batch, adv, plan,
                              observe=lambda i, n, b, m, model: grads.append(
                                  torch.cat([p.grad.flatten() for p in model.parameters()])))
        return grads[0]

    masked = gradient(batch, adv, True)
    assert_close(masked, gradient(without, adv[kept], False), atol=1e-12, rtol=1e-9)
    assert (masked - gradient(batch, adv, False)).abs().max() > 1e-6          # off, the cut rows count


def test_the_sampler_correction_weighs_a_bf16_run_and_is_exactly_one_on_the_fp32_twin(workdir):
    """--sampler-correction truncate (tepo.sampler_correction_weight): in bf16 the old log-probs are recomputed and
    the sampler's kept beside them, so the logged weights pi_old / pi_sampler differ from 1 by bf16's rounding, and
    the loop trains (the effect check, too, reads what the loss read); --top-entropy-share reads the old policy's
    entropy and logs the share it kept. In fp32 with the loop sampler (the fast twin) the old log-probs are the
    sampler's: every weight is exactly 1. The sampler's log-probs are kept whatever they cost (step_settings);
    --no-fast (model.generate gives none) and --engine trl are refused in one line."""
    from tepokit.core.step_settings import sampler_logprobs_wanted
    from tepokit.tests.helpers import assert_refused_in_one_line
    run_main([*MICRO, "--objective", "grpo", "--steps", "2", "--precision", "bf16", "--sampler-correction", "truncate",
              "--top-entropy-share", "0.5", "--effect-check-every", "1", "--out", "runs/corrected_bf16"])
    rows = [r for r in read_rows("runs/corrected_bf16") if "sampler_correction/weight_mean" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["logprobs/sampling_vs_recomputed_max_abs"] > 0 for r in rows)      # the gap the weight corrects
    assert any(r["sampler_correction/weight_min"] != 1 or r["sampler_correction/weight_max"] != 1 for r in rows)
    assert all(r["sampler_correction/weight_min"] <= r["sampler_correction/weight_mean"]
               <= r["sampler_correction/weight_max"] <= 2 for r in rows)
    assert all(0 <= r["sampler_correction/capped_frac"] <= 1 for r in rows)
    assert all(0 < r["top_entropy/kept_frac"] < 1 and "effect/kl_ref/update_change" in r for r in rows)
    run_main([*MICRO, "--objective", "grpo", "--steps", "2", "--sampler-correction", "truncate",
              "--out", "runs/corrected_fp32"])
    rows = [r for r in read_rows("runs/corrected_fp32") if "sampler_correction/weight_mean" in r]
    assert len(rows) == 2 and all(r[f"sampler_correction/{k}"] == v for r in rows for k, v in
                                  (("weight_min", 1), ("weight_mean", 1), ("weight_max", 1), ("capped_frac", 0)))
    assert sampler_logprobs_wanted(True, True, False, 2**40, corrected=True)
    assert not sampler_logprobs_wanted(True, True, False, 2**40)
    assert not sampler_logprobs_wanted(False, True, True, 0, corrected=True)          # --no-fast: none to keep
    assert_refused_in_one_line(["--no-fast", "--sampler-correction", "truncate"], "--sampler-correction", "--no-fast")
    assert_refused_in_one_line(["--engine", "trl", "--top-entropy-share", "0.2"], "--top-entropy-share", "--engine")
