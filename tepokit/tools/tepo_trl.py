"""tepokit/tools/tepo_trl.py: any tepo objective inside TRL's GRPOTrainer, so the function you read in tepo.py is
the one that trains at scale (several GPUs through accelerate / DeepSpeed, vLLM generation, PEFT).

Written for TRL 1.16 (trl>=1.16,<1.17): it overrides two private methods of GRPOTrainer,
`_generate_and_score_completions` and `_compute_loss`, whose names and inputs change between
TRL releases.

What TRL does, unchanged: prompts, sampling, rewards, group-relative advantages (`scale_rewards`,
std + 1e-4), old and reference log-probs, the optimizer, gradient accumulation, distribution and
logging. What tepo does: the loss, `tepo.OBJECTIVES[name](logp, old_logp, advantages, mask, cfg, ...)`,
with the token / sequence counts of the whole optimizer step (exact gradient accumulation, see
tepo.aggregate_loss), plus the one input TRL does not compute: the rollout entropy, for TEPO's
`entropy_criterion="measured"` (tepo.needs_entropy).

Several processes (tepokit/tests/test_tepo_trl_distributed.py runs two): rewards are gathered, so group
advantages and the logged reward are those of all rows; the loss is normalised by the token / sequence
counts of the global optimizer step, so the update of P processes equals one process accumulating the
same P micro-batches. The batch statistics inside an objective (TEPO's `entropy_criterion="cov"` means,
Clip-Cov / KL-Cov token selection and its counts, MPO's block-mean) are those of the micro-batch one process
sees, as in verl, with no communication inside the loss; they therefore depend on the micro-batch size.
Logged metrics combine the processes' micro-batches (token means weigh each process by its tokens).

    import tepo
    from tepokit.tools.tepo_trl import TepoGRPOTrainer, grpo_config
    cfg = tepo.config_for("tepo")                      # paper defaults; any field can be overridden
    args = grpo_config("tepo", cfg, output_dir="out", num_generations=8, max_completion_length=256)
    trainer = TepoGRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward, args=args,
                              train_dataset=prompts, objective="tepo", objective_config=cfg)
    trainer.train()

`python train_small.py --engine trl` runs the built-in task (or --model / --dataset) through it
(`train` below); `accelerate launch --num_processes N train_small.py --engine trl ...` is the scale-out
command on N GPUs (docs/scaling-out.md), `torchrun --nproc_per_node N train_small.py --engine trl ...` the
same on GPUs or CPUs (accelerate's --cpu launches one process unless it goes through MPI).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from decimal import Decimal

import torch
from transformers import TrainerCallback
from transformers.integrations import get_reporting_integration_callbacks
from trl import GRPOConfig, GRPOTrainer

import tepo
from tepokit.cli.flags import objective_config
from tepokit.plumbing.errors import fail
from tepokit.plumbing.hub import without_transformers_bars
from tepokit.setup.lora import peft_config_for
from tepokit.setup.model import prepare_start_model
from tepokit.plumbing.report import KeepTrainingIfReportingFails, trackers_of
from tepokit.cli.resume import CANNOT_RESUME, check_same_run, newest_whole_trl_checkpoint, set_aside_trl_checkpoints
from tepokit.plumbing.rundir import (append_row, claim_run_dir, code_version, read_log, run_identity, run_name,
                                     save_pretrained_atomically, seed_everything, to_json, truncate_log, utc_now,
                                     write_atomically, write_json)
from tepokit.diagnostics.completions import (PROMPTS_LOGGED, CannotLearnWatch, logs_completions, rows_of,
                                             show_completions)
from tepokit.plumbing.signals import StopSignals, stopped_after
from tepokit.setup.task import load_task, task_fingerprint
from tepokit.core.reward import (chat_messages, check_chat_template, gold_answer, prompt_texts, score_completions,
                                 uses_chat_template, weighted_rewards)

TRL_TESTED = "1.16"

# TRL switches that change TRL's own loss. TepoGRPOTrainer's loss is tepo's and does not apply them, so
# they must keep these values (checked on construction rather than silently ignored).
# (use_bias_correction_kl, on by default in TRL 1.16, multiplies the KL term by the ratio: it only
# matters when beta != 0.)
TRL_LOSS_SWITCHES = {"top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
                     "off_policy_mask_threshold": None, "delta": None, "use_bias_correction_kl": False}

# tepo metric -> TRL's name for the same quantity (clip_ratio/* already share TRL's names). tepo's
# "loss" is not logged: the Trainer logs the loss it back-propagated.
TRL_METRIC_NAMES = {"kl_ref": "kl"}

# How a metric of one micro-batch combines over processes into the value of all processes' micro-batches
# taken together (TepoGRPOTrainer._log_across_processes). Not named here: a mean over valid tokens
# (clip_ratio/*_mean, ratio/mean, kl_old/*, kl, kl_mask/*, cov/mean, entropy), so each process weighs by its
# valid tokens, as TRL's own metrics do; a mean of per-process means is off whenever lengths differ.
# pg_loss / kl_loss are already normalised by the global counts (each process holds 1/P of the sum);
# on_policy is a per-micro-batch flag, so its mean is the fraction of on-policy micro-batches.
LOSS_PARTS = ("pg_loss", "kl_loss")
MEAN_OVER_PROCESSES = (*LOSS_PARTS, "on_policy")
SUM_OVER_PROCESSES = ("cov/n_selected",)


def grpo_config(objective: str, cfg: tepo.ObjectiveConfig, **trl_settings) -> GRPOConfig:
    """A GRPOConfig whose data-side settings agree with the objective's config.

    Carried over: eps_low / eps_high -> epsilon / epsilon_high and sapo_tau_pos / _neg -> sapo_temperature_pos /
    _neg (informative: the loss reads cfg), advantage_scale -> scale_rewards, and beta -> beta only when the
    objective needs a reference model (tepo.needs_ref), because TRL loads one and computes its log-probs exactly
    when beta != 0.
    Not carried over (TRL has no such switch): adv_eps (TRL's is 1e-4), dynamic_sampling (TRL keeps
    zero-std groups, with advantage 0), overlong_penalty (add it as a reward function, see `train`).
    use_bias_correction_kl is turned off: tepo's KL terms have no ratio weight.
    """
    carried = dict(epsilon=cfg.eps_low, epsilon_high=cfg.eps_high, sapo_temperature_pos=cfg.sapo_tau_pos,
                   sapo_temperature_neg=cfg.sapo_tau_neg, scale_rewards=cfg.advantage_scale,
                   beta=cfg.beta if tepo.needs_ref(objective, cfg) else 0.0, use_bias_correction_kl=False)
    return GRPOConfig(**{**carried, **trl_settings})


class TepoGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is tepo.OBJECTIVES[objective] with `objective_config` (default: the
    paper defaults, tepo.PAPER_DEFAULTS). Everything else is TRL's."""

    def __init__(self, model, reward_funcs, args: GRPOConfig, *, objective: str,
                 objective_config: tepo.ObjectiveConfig | None = None, completions_every: int = 0,
                 completions_path: str | None = None, **trl_kwargs):
        cfg = tepo.config_for(objective) if objective_config is None else objective_config
        for name, default in TRL_LOSS_SWITCHES.items():
            if getattr(args, name) != default and (name != "use_bias_correction_kl" or args.beta != 0):
                raise ValueError(f"{name}={getattr(args, name)!r} is not applied by TepoGRPOTrainer (its loss is "
                                 f"tepo's); choose {default!r}")
        if args.use_vllm and args.vllm_importance_sampling_correction:
            raise ValueError("vllm_importance_sampling_correction=True is not applied by TepoGRPOTrainer (tepo's "
                             "objectives take no per-token weight); choose False")
        if (args.beta != 0) != tepo.needs_ref(objective, cfg):
            raise ValueError(f"beta={args.beta!r}: TRL computes reference log-probs only when beta != 0, and "
                             f"{objective} {'needs' if tepo.needs_ref(objective, cfg) else 'does not need'} them; "
                             f"build the GRPOConfig with tepo_trl.grpo_config")
        # Dr. GRPO's constant L is the maximum completion length, as in TRL's dr_grpo
        if cfg.aggregation == "seq-mean-token-sum-norm" and cfg.norm_constant is None:
            cfg = dataclasses.replace(cfg, norm_constant=float(args.max_completion_length))
        self.objective, self.objective_config = objective, cfg
        self.completions_every, self.completions_path = completions_every, completions_path
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **trl_kwargs)

    def _generate_and_score_completions(self, inputs):
        """TRL's rollout, plus the entropy of the rollout policy [B, T] when the objective needs it; completions.jsonl's
        rows of the RL step (tepokit/diagnostics/completions.py) when task_rewards scored it."""
        output = super()._generate_and_score_completions(inputs)
        if self.completions_path is not None:
            self._log_completions(output)
        if tepo.needs_entropy(self.objective, self.objective_config):
            with torch.no_grad():
                _, output["old_entropy"], _ = self._get_per_token_logps_and_entropies(
                    self.model, torch.cat([output["prompt_ids"], output["completion_ids"]], 1),
                    torch.cat([output["prompt_mask"], output["completion_mask"]], 1),
                    output["completion_ids"].size(1), batch_size=self.args.per_device_train_batch_size,
                    compute_entropy=True)
        return output

    def _log_completions(self, output) -> None:
        """Every process gives its rows' lengths and cuts; the main process appends the rows, from what TRL keeps for
        its completions table: the prompts, completions, rewards and advantages of the rollout, gathered, with
        task_rewards' gold answers and rewards by name (log_extra)."""
        step = self.state.global_step // (self.args.steps_per_generation * self.args.num_iterations) + 1
        if not logs_completions(step, self.completions_every) or "gold" not in self._logs["extra"]:
            return
        ids, mask = output["completion_ids"], output["completion_mask"]                    # [b, T]
        cut = ~torch.isin(ids, torch.tensor(self.eos_token_ids, device=ids.device)).any(1)   # [b] no end token
        tokens = torch.where(cut, ids.size(1), mask.sum(1))        # a cut row's mask is 0 with mask_truncated
        tokens, cut = self.accelerator.gather(torch.stack([tokens, cut.long()], 1)).T.tolist()    # [R] each
        if not self.accelerator.is_main_process:
            return
        R, G, logs = len(tokens), self.num_generations, self._logs
        rollout = {name: list(column)[-R:] for name, column in [*logs.items(), *logs["extra"].items()]
                   if name not in ("rewards", "extra", "images")}
        rewards = [sum(r) for r in zip(*(list(column)[-R:] for column in logs["rewards"].values()))]   # TRL's total
        prompts = [self.processing_class.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                   if isinstance(p, list) else p for p in rollout["prompt"][:PROMPTS_LOGGED * G:G]]
        texts = [reply_text(c) for c in rollout["completion"]]
        parts = {name.removeprefix("rewards/"): rollout[name] for name in rollout if name.startswith("rewards/")}
        for row in rows_of(step, prompts, rollout["gold"][::G], G, texts, rewards, parts, rollout["advantages"],
                           tokens, cut):
            append_row(self.completions_path, row)

    def _compute_loss(self, model, inputs):
        """tepo's objective on one micro-batch of TRL's rollout; its metrics go to TRL's logs."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]   # [B, T]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        logp, entropy, aux_loss = self._get_per_token_logps_and_entropies(                  # [B, T] each
            model, torch.cat([inputs["prompt_ids"], completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1), completion_ids.size(1),
            compute_entropy=True, compute_aux_loss=self.aux_loss_enabled)
        # TRL leaves out the old log-probs when the micro-batch is surely on-policy (one update per rollout)
        old_logp = inputs.get("old_per_token_logps")
        old_logp = logp.detach() if old_logp is None else old_logp
        # Counts over the whole optimizer step, as TRL's dapo / grpo losses use them: the sum of the
        # micro-batch gradients is then the gradient of the whole step. Both are the global step's counts
        # divided by the P processes, because DDP averages the P gradients: the result is each process's
        # sum over the global count. num_items_in_batch counts the tokens of the generation batch on all
        # processes (gathered by TRL); one optimizer step sees accumulation / steps_per_generation of it.
        # Every process holds the same number of rows, so rows x accumulation is the global count / P.
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_tokens = inputs["num_items_in_batch"] / self.accelerator.num_processes
        if mode == "train":
            num_tokens = num_tokens * accumulation / self.args.steps_per_generation
        cfg = self.objective_config
        # MPO's block-mean counts this micro-batch's blocks only, so its loss is divided by the accumulation
        # below; its reference KL, a token mean over num_tokens, is given a count that much smaller so
        # that it is divided once, not twice.
        own_blocks = self.objective == "mpo" and cfg.block_agg == "block-mean"
        loss, metrics = tepo.OBJECTIVES[self.objective](
            logp, old_logp, inputs["advantages"], mask, cfg, ref_logp=inputs.get("ref_per_token_logps"),
            entropy=entropy, old_entropy=inputs.get("old_entropy"),
            num_tokens=num_tokens / accumulation if own_blocks else num_tokens, num_seqs=logp.size(0) * accumulation)
        if own_blocks:
            loss = loss / accumulation
        if self.aux_loss_enabled:          # MoE load balancing, as in TRL
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        if not own_blocks:   # a micro-batch's share of the step's loss parts; TRL averages the micro-steps
            metrics = {k: v * accumulation if k in LOSS_PARTS else v for k, v in metrics.items()}
        metrics = {TRL_METRIC_NAMES.get(k, k): v for k, v in metrics.items() if k != "loss"}
        metrics["entropy"] = tepo.masked_mean(entropy.detach(), mask).item()
        self._log_across_processes(metrics, mode, valid_tokens=mask.sum().item())
        return loss

    def _log_across_processes(self, metrics: dict, mode: str, valid_tokens: float) -> None:
        """Each metric of this micro-batch combined with the other processes' (MEAN_OVER_PROCESSES says
        how); TRL then averages the micro-steps of the log window."""
        local = torch.tensor([*metrics.values(), valid_tokens], dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(local).view(-1, len(metrics) + 1)       # [processes, metrics + 1]
        weights = gathered[:, -1]
        for name, column in zip(metrics, gathered[:, :-1].T):
            if name.endswith("/min"):
                value = column.amin()
            elif name.endswith("/max"):
                value = column.amax()
            elif name in SUM_OVER_PROCESSES:
                value = column.sum()
            elif name in MEAN_OVER_PROCESSES:
                value = column.mean()
            else:
                value = (column * weights).sum() / weights.sum().clamp(min=1)
            self._metrics[mode][name].append(value.item())


# =====================================================================================================
# train_small.py --engine trl: the built-in task (or --model / --dataset) through TepoGRPOTrainer
# =====================================================================================================

def ignore_trls_checkpointing_warning() -> None:
    """TRL 1.16 reads transformers' deprecated is_gradient_checkpointing at every generation: a FutureWarning
    about TRL's code that a user cannot act on (requirements.txt holds TRL to the tested 1.16). Call it
    inside warnings.catch_warnings()."""
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def trl_settings(args, num_processes: int) -> dict:
    """train_small.Args -> GRPOConfig fields. One RL step = one rollout of prompts_per_step x
    group_size completions (over all processes) = mini_batches x epochs optimizer steps, as in
    train_small's own loop. Raises ValueError when the rollout does not split evenly."""
    rollout = args.prompts_per_step * args.group_size
    if rollout % (args.mini_batches * num_processes):
        raise ValueError(f"--mini-batches={args.mini_batches}: a rollout of {rollout} completions does not split "
                         f"into {args.mini_batches} mini-batches on {num_processes} process(es); choose a divisor")
    mini_batch = rollout // (args.mini_batches * num_processes)          # rows per process and optimizer step
    micro_batch = args.micro_batch_size or mini_batch
    if mini_batch % micro_batch:
        raise ValueError(f"--micro-batch-size={args.micro_batch_size}: does not divide the {mini_batch} rows of a "
                         f"mini-batch per process; choose a divisor of {mini_batch}")
    accumulation = mini_batch // micro_batch
    optimizer_steps = args.mini_batches * args.epochs                     # per RL step
    return dict(per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
                steps_per_generation=args.mini_batches * accumulation, num_iterations=args.epochs,
                num_generations=args.group_size, max_completion_length=args.max_new_tokens,
                temperature=args.temperature, top_k=0, top_p=1.0, learning_rate=args.lr,
                lr_scheduler_type="constant_with_warmup", warmup_steps=args.lr_warmup_steps * optimizer_steps,
                weight_decay=0.0, max_grad_norm=args.max_grad_norm, max_steps=args.steps * optimizer_steps,
                logging_steps=optimizer_steps, save_strategy="steps", save_steps=args.save_every * optimizer_steps,
                seed=args.seed, bf16=args.precision == "bf16", activation_checkpointing=args.gradient_checkpointing,
                disable_dropout=True, trust_remote_code=args.trust_remote_code, model_init_kwargs={"dtype": "float32"},
                report_to=trackers_of(args.report_to) or "none", dataloader_num_workers=0,
                mask_truncated_completions=args.mask_truncated)                    # DAPO's overlong filtering


def trl_prompts(questions: list[str], start_model: str, args) -> list:
    """The prompts as TRL takes them: with a chat template (--chat-template, tepokit/core/reward.py), conversations
    (system prompt and question), which TRL renders with the tokenizer's template; else the question's text."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(start_model, trust_remote_code=args.trust_remote_code)
    check_chat_template(tokenizer, args.chat_template, start_model)
    if uses_chat_template(tokenizer, args.chat_template):
        return [chat_messages(q, args.system_prompt) for q in questions]
    return prompt_texts(questions, tokenizer, args)


def reply_text(completion) -> str:
    """A completion's text: a conversational prompt's completion is a list of messages, the assistant's reply last."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def task_rewards(args, cfg: tepo.ObjectiveConfig) -> list:
    """TRL reward functions for train_small's task: --reward's weighted sum (tepokit/core/reward.py), plus DAPO's
    soft length cost when the objective asks for it. Accuracy and each reward are logged with train_small's names."""
    def correct_answer(prompts, completions, gold, log_metric, log_extra, **_):
        completions = [reply_text(c) for c in completions]
        golds = [Decimal(g) if g else None for g in gold]
        strict, lenient = score_completions(completions, golds)
        log_metric("accuracy/strict", strict.mean().item())
        log_metric("accuracy/lenient", lenient.mean().item())
        rewards, parts = weighted_rewards(completions, golds, args.reward)
        log_extra("gold", list(gold))                       # completions.jsonl's columns (TepoGRPOTrainer)
        for name, values in parts.items():
            log_metric(f"rewards/{name}/mean", values.mean().item())
            log_extra(f"rewards/{name}", values.tolist())
        return rewards.tolist()

    def overlong_penalty(completion_ids, **_):
        lengths = torch.tensor([float(len(ids)) for ids in completion_ids])
        return tepo.soft_overlong_punishment(lengths, args.max_new_tokens, args.overlong_cache).tolist()

    return [correct_answer, overlong_penalty] if cfg.overlong_penalty else [correct_answer]


class StopAtStepEnd(TrainerCallback):
    """A stop signal (tepokit/plumbing/signals.py) ends training at the next RL step's end: TRL saves a checkpoint
    there, and train() writes the logs and says how to resume. Every checkpoint also records the run's
    identity (identity.json), which --resume checks against config.json."""

    def __init__(self, stop, optimizer_steps: int, identity: dict):
        self.stop, self.optimizer_steps, self.identity = stop, optimizer_steps, identity

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop.requested and state.global_step % self.optimizer_steps == 0:
            control.should_save = control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            write_json(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "identity.json"), self.identity)
        return control


class CannotLearnWarnings(TrainerCallback):
    """The built-in engine's warnings of a run that cannot learn (tepokit/diagnostics/completions.py,
    CannotLearnWatch), read from TRL's log row of each RL step (the one with its rollout's `reward`); the row of
    the step a warning fires gets `warning/<name>` = 1, kept in TRL's log history (and so in metrics.jsonl and in
    a checkpoint's trainer state). A resumed run replays its checkpoint's rows first, without a word."""

    def __init__(self, args, optimizer_steps: int):
        self.watch, self.optimizer_steps = CannotLearnWatch(args, print), optimizer_steps

    def on_train_begin(self, args, state, control, **kwargs):
        for row in state.log_history:       # a resumed run's, from its checkpoint
            if "reward" in row:
                self.watch.check({**row, "step": row["step"] // self.optimizer_steps}, quiet=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "reward" in logs:     # the row TRL has just kept, last
            state.log_history[-1].update(self.watch.check({**logs, "step": state.global_step // self.optimizer_steps}))


def train(args, obj_overrides: dict, evaluate) -> dict:
    """One run of train_small's task with TepoGRPOTrainer. Writes <run dir>/config.json, metrics.jsonl
    (one row per RL step: TRL's logs plus tepo's metrics), the final policy and summary.json with
    held-out accuracy before and after (greedy, strict; main process only), measured with `evaluate`,
    train_small.py's evaluation (passed in: the package does not import the script).

    As with the built-in engine: the run directory is locked for the run's lifetime (main process), a stop
    signal ends the run at an RL step's end with a checkpoint and the command that resumes it, and
    --resume continues from TRL's newest whole checkpoint (its trainer state holds the logs so far)."""
    import datasets
    from accelerate import PartialState

    # cpu=True when CUDA is absent: otherwise accelerate sees no distributed CPU launch and every process
    # started by torchrun would run alone, as process 0, into the same run directory
    state = PartialState(cpu=args.device == "cpu" or not torch.cuda.is_available())
    try:
        settings = trl_settings(args, state.num_processes)
    except ValueError as e:
        fail(str(e))
    torch.set_num_threads(args.threads)
    cfg = objective_config(args, obj_overrides)
    run_dir = args.resume or args.out or os.path.join("runs", run_name(args) + "__trl")
    completions_path = os.path.join(run_dir, "completions.jsonl")
    lock = claim_run_dir(run_dir, resume=True) if args.resume and state.is_main_process else None
    device = state.device
    seed_everything(args.seed)
    task = load_task(args)
    with state.main_process_first():          # the built-in warm-up is made (and cached) once
        start_model = prepare_start_model(args, task, device)
    questions, answers = list(task["train"]["question"]), list(task["train"]["answer"])
    golds = [gold_answer(a) for a in answers]
    prompts = datasets.Dataset.from_dict({"prompt": trl_prompts(questions, start_model, args),
                                          "gold": ["" if g is None else str(g) for g in golds]})
    if state.is_main_process and not args.resume:
        lock = claim_run_dir(run_dir, resume=False, overwrite=args.overwrite)
    config = grpo_config(args.objective, cfg, output_dir=run_dir, use_cpu=device.type == "cpu", **settings)
    with without_transformers_bars(when=args.model is None):
        trainer = TepoGRPOTrainer(model=start_model, reward_funcs=task_rewards(args, cfg), args=config,
                                  train_dataset=prompts, objective=args.objective, objective_config=cfg,
                                  completions_every=args.log_completions_every,
                                  completions_path=completions_path,
                                  peft_config=peft_config_for(start_model, args))     # --lora-rank (setup/lora.py)
    reporters = tuple(get_reporting_integration_callbacks(config.report_to))
    trainer.callback_handler.callbacks = [KeepTrainingIfReportingFails(c, run_dir) if isinstance(c, reporters) else c
                                          for c in trainer.callback_handler.callbacks]
    identity = run_identity(args.objective, trainer.model, trainer.processing_class, task_fingerprint(task))
    skipped = {"adv_eps": f"{cfg.adv_eps} -> TRL's 1e-4", "dynamic_sampling": cfg.dynamic_sampling}
    optimizer_steps = args.mini_batches * args.epochs
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    test = task["test"].select(range(min(args.n_test, len(task["test"]))))
    if state.is_main_process:
        print(f"TRL {TRL_TESTED} engine: {args.objective}; not carried over to TRL: {skipped}")
        if args.resume:
            check_same_run(run_dir, identity)
            before = read_log(metrics_path)[0]           # step 0: the start model's evaluation
        else:
            write_json(os.path.join(run_dir, "config.json"), {
                "args": dataclasses.asdict(args), "objective_overrides": obj_overrides,
                "objective_config": dataclasses.asdict(trainer.objective_config), "identity": identity,
                "start_model": start_model, "engine": "trl", "not_carried_over": skipped,
                "grpo_config": json.loads(json.dumps(config.to_dict(), default=str)),
                "started_at": utc_now(), "code": code_version()})
            before = {"step": 0, **evaluate(trainer.model, trainer.processing_class, test, args, device)}
            write_atomically(metrics_path, lambda f: f.write((to_json(before) + "\n").encode()))
    resume_from = resume_checkpoint(run_dir, state, optimizer_steps) if args.resume else None
    if resume_from and state.is_main_process and os.path.exists(completions_path):   # a step cut short is made again
        truncate_log(completions_path, int(resume_from.rsplit("-", 1)[1]) // optimizer_steps + 1)
    # The stop signals are recorded until the summary is written: training stops at an RL step's end with a
    # checkpoint (StopAtStepEnd); a signal during the last step, the final save or the summary waits for them.
    with StopSignals(finish_step=True) as stop:
        with without_transformers_bars(), warnings.catch_warnings():
            ignore_trls_checkpointing_warning()
            trainer.add_callback(StopAtStepEnd(stop, optimizer_steps, identity))
            trainer.add_callback(CannotLearnWarnings(args, optimizer_steps))
            trainer.train(resume_from_checkpoint=resume_from)
        step = trainer.state.global_step // optimizer_steps      # the RL step TRL stopped after
        if not state.is_main_process:
            leave_process_group()
            return {"run_dir": run_dir}
        rows = [before] + [{"step": h["step"] // optimizer_steps, **{k: v for k, v in h.items() if k != "step"}}
                           for h in trainer.state.log_history if "reward" in h]
        if step < args.steps:          # stopped by a signal: TRL saved a checkpoint at this step's end
            write_atomically(metrics_path, lambda f: f.write("".join(to_json(r) + "\n" for r in rows).encode()))
            leave_process_group()
            raise stopped_after(stop.signum, step, args.steps, run_dir)
        save_pretrained_atomically(trainer.model, trainer.processing_class, os.path.join(run_dir, "policy"))
        after = evaluate(trainer.model, trainer.processing_class, test, args, device)
        rows[-1].update(after)
        write_atomically(metrics_path, lambda f: f.write("".join(to_json(r) + "\n" for r in rows).encode()))
        summary = {"run_dir": run_dir, "engine": "trl", "objective": args.objective, "seed": args.seed,
                   "start_accuracy": before["eval/accuracy"], "final_accuracy": after["eval/accuracy"],
                   "gain_points": 100 * (after["eval/accuracy"] - before["eval/accuracy"])}
        write_json(os.path.join(run_dir, "summary.json"), summary)
        print(f"held-out accuracy {summary['start_accuracy']:.3f} -> {summary['final_accuracy']:.3f}; {run_dir}")
        for label, text in show_completions(run_dir):       # as the loop's summary shows them
            print(f"  {label:<20} {text}")
        if lock is not None:
            lock.close()
        leave_process_group()
        if stop.requested:             # it came during the last step, the final save or the summary
            raise stopped_after(stop.signum, step, args.steps, run_dir)
    return summary


def resume_checkpoint(run_dir: str, state, optimizer_steps: int) -> str:
    """The checkpoint that --resume continues from, called by every process: the newest whole one
    (resume.newest_whole_trl_checkpoint; check_resumable has checked it). Newer incomplete ones, left by a
    process killed while saving, are set aside (resume.set_aside_trl_checkpoints) by the main process, which
    holds the run directory's lock, once every process has chosen; one line says so."""
    newest, skipped = newest_whole_trl_checkpoint(run_dir)
    if newest is None:       # check_resumable found a whole one: only a change since then leaves none
        fail(f"argument --resume: {run_dir} no longer holds a whole checkpoint-* directory; {CANNOT_RESUME}")
    state.wait_for_everyone()              # no process may find a checkpoint renamed while it looks
    if skipped and state.is_main_process:
        set_aside = set_aside_trl_checkpoints([path for path, _ in skipped])
        chosen, optimizer_step = newest
        print("; ".join(f"{os.path.basename(path)} is incomplete ({why}), set aside as {os.path.basename(renamed)}"
                        for (path, why), renamed in zip(skipped, set_aside))
              + f"; resuming from {os.path.basename(chosen)}, RL step {optimizer_step // optimizer_steps}", flush=True)
    state.wait_for_everyone()
    return newest[0]


def leave_process_group() -> None:
    """With several processes: all of them meet, then the process group is closed. A process that exits with
    gloo's threads still running can be aborted by the C++ runtime ("terminate called without an active
    exception") after its work is done, failing the launch. Nothing to do in one process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
