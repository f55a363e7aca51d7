"""One optimizer step of TepoGRPOTrainer on a fixed global batch, in one process or in each process of a
torchrun launch (test_tepo_trl_distributed.py compares the two):

    torchrun --standalone --nproc_per_node 2 -m tepokit.tests.fixed_batch_step MODEL_DIR OUT_DIR tepo grpo

The global batch is the same whatever the number of processes: 2 prompts x 4 completions whose tokens are
fixed per (prompt, index in the group) (FixedBatchTrainer's rollout), rewards computed from them, and old
log-probs = the model's + fixed noise per (row, position), so the first step is off-policy and clipping
and TEPO's KL mask act. TRL's shuffle of the rollout is turned off: one process accumulating 2
micro-batches of 4 rows then sees exactly the rows that 2 processes see, one micro-batch each.
"""
from __future__ import annotations

import argparse
import os
import warnings
from unittest import mock

import torch

# prompts of one length: a position depends on the left padding, which is to the longest prompt of all
# rows in one process but of each process's own rows in two
PROMPTS = ["Ann has 2 eggs and got 1 more. How many eggs now?\n", "Bob has 2 bags of 2 pens each. How many pens now?\n"]
GROUP_SIZE = 4
ROWS = len(PROMPTS) * GROUP_SIZE            # the global batch, one optimizer step
# completion lengths per (prompt, index in group): the two groups hold 24 and 20 tokens, so two processes
# (one group each) have different token counts and a per-process normalisation shows
LENGTHS = [[3, 7, 5, 9], [4, 2, 8, 6]]
MAX_COMPLETION = max(max(row) for row in LENGTHS)
OLD_LOGP_NOISE = 0.01                        # TEPO's GSPO-like eps (3e-4, 4e-4): some sequences clip, some not
LEARNING_RATE = 0.1


def save_tiny_model(model_dir: str) -> None:
    """A 1-layer GPT-2 of width 16 (seeded) with the built-in character tokenizer over PROMPTS."""
    from transformers import AutoModelForCausalLM, GPT2Config
    from tepokit.setup.model import build_char_tokenizer
    tokenizer = build_char_tokenizer(PROMPTS)
    end = tokenizer.eos_token_id
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=96, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=end, eos_token_id=end, pad_token_id=end)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def fixed_completion(prompt_index: int, index_in_group: int, vocab_size: int) -> list[int]:
    """The completion's token ids: seeded by (prompt, index in group), never the end token (id 0)."""
    g = torch.Generator().manual_seed(1000 * prompt_index + index_in_group)
    return torch.randint(2, vocab_size, (LENGTHS[prompt_index][index_in_group],), generator=g).tolist()


def reward_by_length(completion_ids, **_):
    """Rewards that differ within both groups: the length mod 3."""
    return [float(len(ids) % 3) for ids in completion_ids]


def expected_reward_mean() -> float:
    lengths = [n for row in LENGTHS for n in row]
    return sum(n % 3 for n in lengths) / len(lengths)


def fixed_rollout(prompts: list, trainer) -> dict:
    """TRL's rollout_func: this process's rows are rows [rank * n, (rank + 1) * n) of the global batch (TRL
    slices advantages the same way), and groups are contiguous, so the global row index mod G is the index
    in the group."""
    tokenizer = trainer.processing_class
    first = trainer.accelerator.process_index * len(prompts)
    completions = [fixed_completion(PROMPTS.index(p), (first + i) % GROUP_SIZE, len(tokenizer))
                   for i, p in enumerate(prompts)]
    return {"prompt_ids": [tokenizer(p).input_ids for p in prompts], "completion_ids": completions,
            "logprobs": None}


def build_trainer(model_dir: str, objective: str, out_dir: str, micro_batch: int | None = None,
                  per_rank_token_count: bool = False):
    """A TepoGRPOTrainer whose single optimizer step sees the fixed global batch: ROWS / P rows per process,
    in micro-batches of `micro_batch` rows (default: one micro-batch per process). per_rank_token_count:
    the negative control, a token count that was not gathered over processes (each normalises by its own)."""
    import datasets
    import tepo
    from tepokit.tools import tepo_trl

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch = micro_batch or ROWS // processes
    accumulation = ROWS // (micro_batch * processes)

    class FixedBatchTrainer(tepo_trl.TepoGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
            attention = torch.cat([output["prompt_mask"], output["completion_mask"]], 1)
            with torch.no_grad():
                logp, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, attention,
                                                                     output["completion_ids"].size(1))
            rows = self.accelerator.process_index * logp.size(0) + torch.arange(logp.size(0))
            noise = torch.randn(ROWS, MAX_COMPLETION, generator=torch.Generator().manual_seed(7))
            output["old_per_token_logps"] = logp + OLD_LOGP_NOISE * noise[rows, :logp.size(1)]
            if per_rank_token_count:   # this process's tokens as if they were all processes' (the adapter / P)
                output["num_items_in_batch"] = output["completion_mask"].sum() * self.accelerator.num_processes
            return output

        def _log_across_processes(self, metrics, mode, valid_tokens):
            self.logged_micro_batches.append((dict(metrics), valid_tokens))
            super()._log_across_processes(metrics, mode, valid_tokens)

    cfg = tepo.config_for(objective)
    config = tepo_trl.grpo_config(
        objective, cfg, output_dir=out_dir, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, num_generations=GROUP_SIZE, max_completion_length=MAX_COMPLETION,
        max_steps=1, logging_steps=1, optim="sgd", learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=0.0, seed=0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        disable_dropout=True, model_init_kwargs={"dtype": "float32"}, dataloader_num_workers=0)
    prompts = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with warnings.catch_warnings():             # TRL calls rollout_func experimental
        warnings.filterwarnings("ignore", message=".*rollout_func")
        trainer = FixedBatchTrainer(model=model_dir, reward_funcs=reward_by_length, args=config,
                                    train_dataset=prompts, objective=objective, objective_config=cfg,
                                    rollout_func=fixed_rollout)
    trainer.logged_micro_batches = []         # (metrics, valid tokens) of this process's micro-batches
    return trainer


def one_step(model_dir: str, objective: str, out_dir: str, micro_batch: int | None = None,
             per_rank_token_count: bool = False) -> dict:
    """Train one optimizer step; returns the parameters after it, TRL's log row and the micro-batch metrics."""
    trainer = build_trainer(model_dir, objective, out_dir, micro_batch, per_rank_token_count)
    keep_order = mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", lambda batch: batch)
    with keep_order:
        trainer.train()
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return {"params": params, "log": trainer.state.log_history[0], "micro_batches": trainer.logged_micro_batches}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir", help="<out_dir>/<case>.pt is written by process 0")
    parser.add_argument("cases", nargs="+", help="an objective, or <objective>:per_rank_token_count")
    args = parser.parse_args(argv)
    for case in args.cases:
        objective, _, variant = case.partition(":")
        result = one_step(args.model_dir, objective, os.path.join(args.out_dir, "trainer"),
                          per_rank_token_count=variant == "per_rank_token_count")
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(result, os.path.join(args.out_dir, f"{case.replace(':', '_')}.pt"))
    from tepokit.tools.tepo_trl import leave_process_group
    leave_process_group()       # all processes meet and close the group: exiting with gloo's threads alive can abort


if __name__ == "__main__":
    main()
