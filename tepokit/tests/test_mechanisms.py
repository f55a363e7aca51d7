"""tepokit/diagnostics/mechanisms.py: what each mechanism did to the update, against the update computed without it."""
import copy
import dataclasses
import math

import pytest
import torch

import tepo
import train_small as ts
from tepokit.core.taps import UpdateTaps
from tepokit.diagnostics.mechanisms import (OFF, effect_check_interval, mechanism_effects, mechanism_gradients,
                                            mechanisms, parameters_set_to)
from tepokit.core.step_settings import step_settings
from tepokit.tests.helpers import F64, MICRO, hand_batch, micro_run, read_rows, run_main, without_timing
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
                       ref_logp=ref_logp)
    return model, batch, adv, plan, old, settings


def parameters_of(model) -> list:
    """A copy of the model's parameters, in model.parameters() order (as the update's taps keep them)."""
    return [p.detach().clone() for p in model.parameters()]


# (objective, the mechanism, settings under which it acts off-policy)
ACTING = [("grpo", "clip_low", {}), ("grpo", "clip_high", {}), ("grpo", "kl_ref", dict(beta=0.04)),
          ("ppo", "dual_clip", dict(dual_clip_c=1.5)), ("dapo", "clip_high", {}), ("gspo", "clip_high", {}),
          ("clip_cov", "clip_cov", dict(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=50.0)),
          ("kl_cov", "kl_cov", dict(kl_cov_ratio=0.2)), ("tepo", "kl_mask", {}),
          # hard: a band wide enough that the clip leaves the dropped tokens a gradient to drop
          ("tepo", "kl_mask", dict(kl_mode="hard", kl_tau=0.01, eps_low=0.5, eps_high=0.5)), ("mpo", "clip_low", {}),
          # CISPO's cap changes the weight, not whether a token has a gradient; GMPO's clip is in log space
          ("cispo", "clip_high", {}), ("gmpo", "clip_high", dict(eps_high=0.1))]
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
        effects = mechanism_effects(model, parameters_of(model), batch, old, adv, plan[-1], objective, cfg, resolved,
                                    seed=1)
        change, tokens = effects[f"effect/{mechanism}/update_change"], effects[f"effect/{mechanism}/tokens"]
        if acts:
            assert change > 1e-3 and tokens > 0, (settings, effects)
            assert effects[f"effect/{mechanism}/tokens_rewarded"] <= tokens
        else:
            assert change == 0 and tokens == 0 and effects[f"effect/{mechanism}/update_cosine"] == pytest.approx(1)
        assert effects["effect/tokens"] == batch.completion_mask[torch.cat(plan[-1])].sum().item()   # the last


@pytest.mark.parametrize("objective", ["grpo", "dapo", "gspo", "kl_cov", "tepo", "mpo", "cispo", "gmpo"])
def test_on_policy_no_ratio_mechanism_acts(objective):
    """At ratio 1 (the rollout's first mini-batch) the clip, KL-Cov's penalty and TEPO's mask (target old) change
    nothing: each is exactly 0. The reference KL is not a ratio mechanism and still acts (GRPO's beta)."""
    cfg = tepo.config_for(objective)
    model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.0)
    effects = mechanism_effects(model, parameters_of(model), batch, old, adv, plan[-1], objective, cfg, resolved,
                                seed=1)
    for name in set(mechanisms(objective, cfg)) - {"kl_ref"}:
        assert effects[f"effect/{name}/update_change"] == 0 and effects[f"effect/{name}/tokens"] == 0, name
    if objective == "grpo":            # beta 0.04 in its paper settings
        assert effects["effect/kl_ref/update_change"] > 0


@pytest.mark.parametrize("objective, mechanism, acting", [ACTING[0], ACTING[6], ACTING[8]])
def test_update_change_is_the_relative_distance_of_two_backward_passes(objective, mechanism, acting):
    """The effect equals |g_on - g_off| / |g_on| and cos(g_on, g_off) of the parameters' gradients from plain
    loss.backward() of the objective on the given mini-batch at the given parameters (not the model's own), with
    the mechanism on and switched off (float64, aggregated as the update aggregates it), and it leaves the model's
    parameters (exactly), their .grad and the RNG untouched."""
    cfg = tepo.config_for(objective, **acting)
    model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.5)
    own = parameters_of(model)
    g = torch.Generator().manual_seed(11)
    measured_at = [p + 0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype) for p in own]  # another step's
    state = torch.get_rng_state()
    effects = mechanism_effects(model, measured_at, batch, old, adv, plan[-1], objective, cfg, resolved, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), own))
    at = copy.deepcopy(model)
    with torch.no_grad():
        for p, value in zip(at.parameters(), measured_at):
            p.copy_(value)

    def gradient(config):                          # of the last mini-batch, the rows the last optimizer step saw
        at.zero_grad(set_to_none=True)
        for micro_batches in plan[-1:]:
            rows = torch.cat(micro_batches)
            counts = dict(num_tokens=batch.completion_mask[rows].sum().item(), num_seqs=float(len(rows)))
            for micro in micro_batches:
                torch.manual_seed(7)       # Clip-Cov's draw: each micro-batch's from the seed, as mechanism_effects
                logits = ts.completion_logits(at, batch, micro, resolved.precision, resolved.prompt_once)
                logp = ts.token_logprobs(logits, batch.completion_ids[micro], resolved.temperature)
                loss, _ = tepo.OBJECTIVES[objective](logp, old.logp[micro], adv[micro], batch.completion_mask[micro],
                                                     config, ref_logp=old.ref_logp[micro], **counts)
                loss.backward()
        grad = torch.cat([p.grad.flatten() for p in at.parameters()])
        at.zero_grad(set_to_none=True)
        return grad

    g_on, g_off = gradient(cfg), gradient(mechanisms(objective, cfg)[mechanism])
    assert effects[f"effect/{mechanism}/update_change"] == pytest.approx(((g_on - g_off).norm() / g_on.norm()).item(),
                                                                          rel=1e-9)
    assert effects[f"effect/{mechanism}/update_cosine"] == pytest.approx(
        torch.nn.functional.cosine_similarity(g_on, g_off, dim=0).item(), rel=1e-9)
    at_own = mechanism_effects(model, own, batch, old, adv, plan[-1], objective, cfg, resolved, seed=7)
    assert at_own[f"effect/{mechanism}/update_change"] != effects[f"effect/{mechanism}/update_change"]  # it matters


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
    assert set(mechanisms("cispo", tepo.config_for("cispo"))) == {"clip_low", "clip_high", "kl_ref"}
    assert set(mechanisms("sapo", tepo.config_for("sapo"))) == {"kl_ref"}      # its gate has no off switch


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


def update_run(objective, overrides, micro_batch_size: int, seed: int = 0):
    """A float64 run of the fast twin over a hand-made rollout of 4 groups of 4 (tepokit.tests.helpers.micro_run):
    2 epochs x 2 mini-batches (4 optimizer steps, the last one's rows overlapping the first's), plain SGD (large
    steps, so the policy drifts within the step), the reference model a perturbed policy when the objective needs
    one. The sampler's log-probs are the policy's own plus noise (the first mini-batch replaces its rows' with its
    own forward: the old policy as the loss saw it differs from the one computed before the update). Returns
    (run, batch, adv, plan)."""
    model = float64_gpt2(vocab=VOCAB)
    batch = hand_batch(VOCAB, rows=ROWS, prompt=5, completion=6, seed=seed)
    cfg = tepo.config_for(objective, **overrides)
    ref = None
    if tepo.needs_ref(objective, cfg):
        ref = copy.deepcopy(model).requires_grad_(False)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5), dtype=F64))
    args = ts.Args(group_size=4, prompts_per_step=4, mini_batches=2, epochs=2, micro_batch_size=micro_batch_size,
                   max_new_tokens=6, temperature=0.9, entropy_check_rows=4)
    run = micro_run(model, None, args, objective, ref_model=ref, recompute=False, **overrides)
    run.optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        logits = ts.completion_logits(model, batch, torch.arange(ROWS), run.settings.precision,
                                      run.settings.prompt_once)
        noise = 0.3 * torch.randn(batch.completion_ids.shape, generator=g, dtype=F64) * batch.completion_mask
        batch.sampling_logp = ts.token_logprobs(logits, batch.completion_ids, args.temperature) + noise
        batch.sampling_entropy = ts.token_entropy(logits, args.temperature)
    adv = torch.randn(ROWS, generator=g, dtype=F64)
    torch.manual_seed(seed + 2)
    plan = ts.minibatch_plan(torch.ones(ROWS, dtype=torch.bool), args, run.settings.rows_per_forward)
    return run, batch, adv, plan


# (objective, its settings, micro-batch rows): GRPO with its reference KL; TEPO with the entropy it measures and
# with its cov criterion; Clip-Cov, whose random draw is per loss call, in one micro-batch per optimizer step
GRADIENT_CASES = [("grpo", dict(beta=0.04), 2), ("tepo", dict(entropy_criterion="measured"), 2), ("tepo", {}, 0),
                  ("clip_cov", dict(clip_cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=50.0), 0)]


@pytest.mark.parametrize("objective, overrides, micro_batch_size", GRADIENT_CASES)
def test_g_on_is_the_gradient_the_last_optimizer_step_applied(objective, overrides, micro_batch_size):
    """mechanism_gradients at the parameters the update's taps kept (UpdateTaps, parameters=True), on the last
    optimizer step's mini-batch (plan[taps.at]) with the old policy as the loss saw it (update_policy's `seen`):
    its g_on is the parameters' .grad that optimizer step accumulated, before clipping (the observer runs
    before clip_grad_norm_), to 1e-9 in float64."""
    run, batch, adv, plan = update_run(objective, overrides, micro_batch_size)
    assert len(plan) == 4 and all(len(mb) == (8 // micro_batch_size if micro_batch_size else 1) for mb in plan)
    taps = UpdateTaps(settings=run.settings, parameters=True)
    seed, recorded = 3, {}

    def observe(i, n, batch, micro_batches, model):
        taps(i, n, batch, micro_batches, model)
        if taps.at == i:                           # the optimizer step whose parameters the taps kept
            recorded["grad"] = [p.grad.detach().clone() for p in model.parameters()]
            recorded["parameters"] = [p.detach().clone() for p in model.parameters()]
        if i == n - 2:        # the next (last) step's loss draws Clip-Cov's tokens as mechanism_gradients does
            torch.manual_seed(seed)

    old = ts.old_policy(run, batch, plan)
    _, seen, _ = ts.update_policy(run, batch, old, adv, plan, observe)
    assert taps.at == len(plan) - 1 and "grad" in recorded
    assert all(torch.equal(p, q) for p, q in zip(taps.kept_parameters, recorded["parameters"]))
    assert not torch.equal(seen.logp, old.logp)              # the twin: the loss saw the first rows' own forward
    with parameters_set_to(run.model, taps.kept_parameters):
        total, _, n_valid = mechanism_gradients(run.model, batch, seen, adv, plan[taps.at], objective, run.cfg,
                                                run.settings, seed)
    assert n_valid == batch.completion_mask[torch.cat(plan[taps.at])].sum().item()
    g_on = torch.cat([g.flatten() for g in total["on"]])
    grad = torch.cat([g.flatten() for g in recorded["grad"]])
    assert g_on.dtype == grad.dtype == F64 and grad.norm() > 1e-3
    assert ((g_on - grad).abs().max() / grad.norm()).item() < 1e-9
    assert torch.allclose(g_on, grad, rtol=0, atol=1e-9)
    # the control: with the old policy as computed before the update (the twin's sampler log-probs, which the loss
    # never saw on the first mini-batch's rows, some of which the last mini-batch holds again) it is not that gradient
    assert set(torch.cat(plan[taps.at]).tolist()) & set(torch.cat(plan[0]).tolist())
    with parameters_set_to(run.model, taps.kept_parameters):
        other, _, _ = mechanism_gradients(run.model, batch, old, adv, plan[taps.at], objective, run.cfg, run.settings,
                                          seed)
    assert not torch.allclose(torch.cat([g.flatten() for g in other["on"]]), grad, rtol=0, atol=1e-9)


SWITCHED_OFF_CASES = [(name, {}) for name in sorted(tepo.OBJECTIVES) if mechanisms(name, tepo.config_for(name))] + [
    (objective, acting) for objective, _, acting in ACTING if acting]


@pytest.mark.parametrize("objective, acting", SWITCHED_OFF_CASES)
def test_a_mechanism_switched_off_by_its_table_entry_changes_nothing(objective, acting):
    """Every mechanism of every objective (its default settings, and the settings under which ACTING makes it
    act), switched off as `mechanisms` switches it off and measured with that config: it touched no token and
    changed the gradient by exactly 0, off-policy (where the mechanisms act), with Clip-Cov's random draw."""
    cfg = tepo.config_for(objective, **acting)
    model, batch, adv, plan, old, resolved = rollout_and_old_policy(objective, cfg, drift=0.5)
    for name, cfg_off in mechanisms(objective, cfg).items():
        effects = mechanism_effects(model, parameters_of(model), batch, old, adv, plan[-1], objective, cfg_off,
                                    resolved, seed=1)
        assert effects[f"effect/{name}/tokens"] == 0, (name, effects)
        assert effects[f"effect/{name}/update_change"] == 0.0, (name, effects)
        assert effects[f"effect/{name}/tokens_rewarded"] == 0, (name, effects)


@pytest.mark.parametrize("objective, overrides, micro_batch_size", GRADIENT_CASES)
def test_the_update_is_the_same_with_and_without_the_taps(objective, overrides, micro_batch_size):
    """Two updates from identical states and the same random stream, one observed by UpdateTaps keeping
    everything it can (the logits before, the parameters, each optimizer step's entropies), one unobserved: the
    same parameters after the step, bit for bit, the same loss metrics, what the loss saw, and the same random
    stream after (Clip-Cov draws inside the update)."""
    out = []
    for observed in (True, False):
        run, batch, adv, plan = update_run(objective, overrides, micro_batch_size)
        taps = UpdateTaps(settings=run.settings, logits_rows=4, parameters=True, entropies=True) if observed \
            else None
        torch.manual_seed(9)
        old = ts.old_policy(run, batch, plan)
        losses, seen, loss_saw = ts.update_policy(run, batch, old, adv, plan, observe=taps)
        out.append((list(run.model.parameters()), losses, seen, loss_saw, torch.get_rng_state(), taps))
    (p_taps, l_taps, s_taps, saw_taps, rng_taps, taps), (p_none, l_none, s_none, saw_none, rng_none, _) = out
    assert taps.logits_before is not None and taps.kept_parameters is not None and len(taps.kept_entropies) == 4
    assert all(torch.equal(p, q) for p, q in zip(p_taps, p_none)) and len(p_taps) == len(p_none)
    assert l_taps == l_none and math.isfinite(l_taps["loss"])
    assert torch.equal(s_taps.logp, s_none.logp) and torch.equal(s_taps.entropy, s_none.entropy)
    for step_taps, step_none in zip(saw_taps, saw_none, strict=True):
        for (rows_t, logp_t, ent_t), (rows_n, logp_n, ent_n) in zip(step_taps, step_none, strict=True):
            assert torch.equal(rows_t, rows_n) and torch.equal(logp_t, logp_n)
            assert (ent_t is None and ent_n is None) or torch.equal(ent_t, ent_n)
    assert torch.equal(rng_taps, rng_none)
