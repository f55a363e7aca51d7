"""tepokit/diagnostics/mechanisms.py: what each mechanism did to the update, against the update computed without it."""
import copy
import dataclasses
import math

import pytest
import torch

import tepo
import train_small as ts
from tepokit.diagnostics.mechanisms import OFF, effect_check_interval, mechanism_effects, mechanisms
from tepokit.fast.step_settings import step_settings
from tepokit.tests.helpers import F64, MICRO, hand_batch, read_rows, run_main, without_timing
from tepokit.tests.test_train_small import float64_gpt2

VOCAB, ROWS = 23, 16


def rollout_and_old_policy(objective, cfg, drift: float, seed: int = 0):
    """A float64 model, a hand-made rollout of 4 groups of 4, advantages, the plan of one epoch of 2 mini-batches,
    an old policy whose log-probs are the model's own plus `drift` x noise (0: exactly on-policy), and the run's
    StepSettings; the reference model is the policy with its weights perturbed."""
    model = float64_gpt2(vocab=VOCAB)
    batch = hand_batch(VOCAB, rows=ROWS, prompt=5, completion=6, seed=seed)
    args = ts.Args(group_size=4, prompts_per_step=4, mini_batches=2, max_new_tokens=6, temperature=0.9,
                   objective=objective)
    settings = step_settings(args, model.config)
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(ROWS, generator=g, dtype=F64)
    plan = ts.minibatch_plan(torch.ones(ROWS, dtype=torch.bool), args, settings.rows_per_forward)
    rows = torch.arange(ROWS)
    with torch.no_grad():
        logits = ts.completion_logits(model, batch, rows, settings.precision, settings.prompt_once)
        logp = ts.token_logprobs(logits, batch.completion_ids, args.temperature)
        entropy = ts.token_entropy(logits, args.temperature)
        ref = copy.deepcopy(model)
        for p in ref.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=F64))
        ref_logp = ts.token_logprobs(ts.completion_logits(ref, batch, rows, settings.precision, settings.prompt_once),
                                     batch.completion_ids, args.temperature)
    old = ts.OldPolicy(logp=logp + drift * torch.randn(logp.shape, generator=g, dtype=F64), entropy=entropy,
                       ref_logp=ref_logp, entropy_check_positions=None)
    return model, batch, adv, plan, old, settings


# (objective, the mechanism, settings under which it acts off-policy)
ACTING = [("grpo", "clip_low", {}), ("grpo", "clip_high", {}), ("grpo", "kl_ref", dict(beta=0.04)),
          ("ppo", "dual_clip", dict(dual_clip_c=1.5)), ("dapo", "clip_high", {}), ("gspo", "clip_high", {}),
          ("clip_cov", "clip_cov", dict(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=50.0)),
          ("kl_cov", "kl_cov", dict(kl_cov_ratio=0.2)), ("tepo", "kl_mask", {}),
          # hard: a band wide enough that the clip leaves the dropped tokens a gradient to drop
          ("tepo", "kl_mask", dict(kl_mode="hard", kl_tau=0.01, eps_low=0.5, eps_high=0.5)), ("mpo", "clip_low", {})]
# the same mechanisms, switched off by the settings alone
SWITCHED_OFF = {"clip_low": dict(eps_low=OFF), "clip_high": dict(eps_high=OFF), "kl_ref": dict(beta=0.0),
                "dual_clip": dict(dual_clip_c=None), "clip_cov": dict(clip_cov_ratio=0.0),
                "kl_cov": dict(beta=0.0), "kl_mask": dict(beta=0.0, kl_tau=OFF)}


@pytest.mark.parametrize("objective, mechanism, acting", ACTING)
def test_each_mechanism_changes_the_update_where_it_acts_and_nothing_where_it_is_switched_off(objective, mechanism,
                                                                                              acting):
    for settings, acts in ((acting, True), ({**acting, **SWITCHED_OFF[mechanism]}, False)):
        cfg = tepo.config_for(objective, **settings)
        model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.5)
        effects = mechanism_effects(model, batch, old, adv, plan, objective, cfg, resolved, seed=1)
        change, tokens = effects[f"effect/{mechanism}/update_change"], effects[f"effect/{mechanism}/tokens"]
        if acts:
            assert change > 1e-3 and tokens > 0, (settings, effects)
            assert effects[f"effect/{mechanism}/tokens_rewarded"] <= tokens
        else:
            assert change == 0 and tokens == 0 and effects[f"effect/{mechanism}/update_cosine"] == pytest.approx(1)
        assert effects["effect/tokens"] == batch.completion_mask[torch.cat(plan[-1])].sum().item()   # the last


@pytest.mark.parametrize("objective", ["grpo", "dapo", "gspo", "kl_cov", "tepo", "mpo"])
def test_on_policy_no_ratio_mechanism_acts(objective):
    """At ratio 1 (the rollout's first mini-batch) the clip, KL-Cov's penalty and TEPO's mask (target old) change
    nothing: each is exactly 0. The reference KL is not a ratio mechanism and still acts (GRPO's beta)."""
    cfg = tepo.config_for(objective)
    model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.0)
    effects = mechanism_effects(model, batch, old, adv, plan, objective, cfg, resolved, seed=1)
    for name in set(mechanisms(objective, cfg)) - {"kl_ref"}:
        assert effects[f"effect/{name}/update_change"] == 0 and effects[f"effect/{name}/tokens"] == 0, name
    if objective == "grpo":            # beta 0.04 in its paper settings
        assert effects["effect/kl_ref/update_change"] > 0


@pytest.mark.parametrize("objective, mechanism, acting", [ACTING[0], ACTING[6], ACTING[8]])
def test_update_change_is_the_relative_distance_of_two_backward_passes(objective, mechanism, acting):
    """The effect equals |g_on - g_off| / |g_on| and cos(g_on, g_off) of the parameters' gradients from plain
    loss.backward() of the objective on the last mini-batch, with the mechanism on and switched off (float64,
    aggregated as the update aggregates it), and it leaves the parameters' .grad and the RNG untouched."""
    cfg = tepo.config_for(objective, **acting)
    model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.5)
    state = torch.get_rng_state()
    effects = mechanism_effects(model, batch, old, adv, plan, objective, cfg, resolved, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())

    def gradient(config):                          # of the last mini-batch, the rows the last optimizer step saw
        model.zero_grad(set_to_none=True)
        for micro_batches in plan[-1:]:
            rows = torch.cat(micro_batches)
            counts = dict(num_tokens=batch.completion_mask[rows].sum().item(), num_seqs=float(len(rows)))
            for micro in micro_batches:
                torch.manual_seed(7)       # Clip-Cov's draw: each micro-batch's from the seed, as mechanism_effects
                logits = ts.completion_logits(model, batch, micro, resolved.precision, resolved.prompt_once)
                logp = ts.token_logprobs(logits, batch.completion_ids[micro], resolved.temperature)
                loss, _ = tepo.OBJECTIVES[objective](logp, old.logp[micro], adv[micro], batch.completion_mask[micro],
                                                     config, ref_logp=old.ref_logp[micro], **counts)
                loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        return grad

    g_on, g_off = gradient(cfg), gradient(mechanisms(objective, cfg)[mechanism])
    assert effects[f"effect/{mechanism}/update_change"] == pytest.approx(((g_on - g_off).norm() / g_on.norm()).item(),
                                                                          rel=1e-9)
    assert effects[f"effect/{mechanism}/update_cosine"] == pytest.approx(
        torch.nn.functional.cosine_similarity(g_on, g_off, dim=0).item(), rel=1e-9)


def test_the_effects_are_measured_every_4th_step_on_the_built_in_model_and_only_when_asked_with_a_model():
    unset = ts.Args().effect_check_every                      # --effect-check-every not given; --model unset: None
    assert effect_check_interval(unset, None) == 4
    assert effect_check_interval(unset, "Qwen/Qwen2.5-0.5B-Instruct") == 0
    assert effect_check_interval(8, "gpt2") == 8
    assert effect_check_interval(0, None) == 0


def test_the_table_switches_off_one_setting_and_lists_every_objectives_mechanisms():
    for name in tepo.OBJECTIVES:
        cfg = tepo.config_for(name)
        for mechanism, off in mechanisms(name, cfg).items():
            changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(off, f.name)}
            assert len(changed) <= 1, (name, mechanism, changed)
            assert changed <= set(tepo.FIELDS_READ[name]), (name, mechanism, changed)
    assert set(mechanisms("tepo", tepo.config_for("tepo"))) == {"clip_low", "clip_high", "kl_mask"}
    assert set(mechanisms("kl_cov", tepo.config_for("kl_cov"))) == {"kl_cov"}
    assert set(mechanisms("clip_cov", tepo.config_for("clip_cov"))) == {"clip_low", "clip_high", "kl_ref", "clip_cov"}


def test_a_run_logs_the_effects_on_its_checked_steps_and_trains_the_same_without_them(workdir):
    """--effect-check-every 2: steps 2 and 4 carry effect/ metrics for each mechanism of the objective, the others
    none; with --effect-check-every 0 the run's every other number is the same (the update never knew)."""
    common = [*MICRO, "--objective", "tepo", "--steps", "4", "--mini-batches", "2", "--epochs", "2",
              "--no-dynamic-sampling"]
    run_main([*common, "--effect-check-every", "2", "--out", "runs/effects_on"])
    run_main([*common, "--effect-check-every", "0", "--out", "runs/effects_off"])
    on, off = read_rows("runs/effects_on"), read_rows("runs/effects_off")
    for row in on[1:]:
        has = {k for k in row if k.startswith("effect/")}
        if row["step"] % 2 == 0:
            assert {f"effect/{m}/{x}" for m in ("clip_low", "clip_high", "kl_mask")
                    for x in ("tokens", "tokens_rewarded", "update_change", "update_cosine")} <= has
        else:
            assert not has
    assert all(math.isfinite(r["effect/kl_mask/update_change"]) for r in on[1:] if r["step"] % 2 == 0)
    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("effect/")} for r in without_timing(rows)]
    assert strip(on) == strip(off)
