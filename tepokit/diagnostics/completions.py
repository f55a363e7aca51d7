"""completions.jsonl, the completions a user reads; and the warnings of a run that cannot learn.

Reading completions is how truncation, a wrong answer format and reward hacking are spotted: the metrics only say
that something is wrong. Every --log-completions-every steps, and at step 1 (so that a wrong format shows at once),
the loop appends to completions.jsonl one row for each of the step's first PROMPTS_LOGGED prompts (completion_rows):
the prompt as the model saw it, the gold answer, the G rewards of its group, and its first COMPLETIONS_LOGGED
completions, each with its text, its rewards by name and their total, its advantage, its length and whether it was
cut. show_completions prints a few of them in the summary that ends a run. --engine trl writes the same rows from
TRL's rollout (tepokit/tools/tepo_trl.py, TepoGRPOTrainer; rows_of builds them for both).

Two failures leave the loss near 0 and the metrics calm while nothing is learned (the questions "my loss is 0" and
"the quickstart truncated most completions"): most completions cut at --max-new-tokens, where a completion has no
final answer for the reward to read; and every group's rewards equal, where every advantage is 0. CannotLearnWatch
reads each metrics.jsonl row and says so in one line when one of them lasts STREAK steps in a row, once per streak;
the row of that step gets `warning/truncation` or `warning/no_signal` = 1. --engine trl reads TRL's log rows with it
(tepokit/tools/tepo_trl.py, CannotLearnWarnings)."""

from __future__ import annotations

import json
import os

from tepokit.core.reward import gold_answer
from tepokit.plumbing.rundir import read_log

PROMPTS_LOGGED = 2          # prompts per logged step: the step's first (its prompts are a seeded random draw)
COMPLETIONS_LOGGED = 4      # completions per prompt: the first of its G, in the order they were sampled (unpicked)
# 5 steps in a row: in the committed logs of the README's runs (notebooks/logs/: the default, --demo, --task
# hidden-type, --compare grpo,tepo; 30 runs) no step has more than 4% of its completions cut, and every group's
# rewards are equal at most 3 steps in a row; runs that cannot learn (an entropy bonus of 1.0, hidden_type_2026-11-25/
# grpo_beta=0_entropy_coef=1.0__*) have each for 93 to 133 steps in a row (tests/test_completions.py replays them).
STREAK = 5
MOST_CUT = 0.5              # more than half the completions cut at --max-new-tokens


def logs_completions(step: int, every: int) -> bool:
    """Whether step `step` writes completions.jsonl rows: step 1 and every `every`-th step (0: never). A function of
    the step alone, so a resumed run writes the rows of an uninterrupted one."""
    return every > 0 and (step == 1 or step % every == 0)


def completion_rows(run, step: int, record) -> list[dict]:
    """completions.jsonl's rows of one RL step (none on the steps logs_completions skips). record: what rl_step did
    (train_small.StepRecord); from the run it reads its settings and tokenizer."""
    args, batch, G = run.args, record.batch, run.args.group_size
    if not logs_completions(step, args.log_completions_every):
        return []
    rewards = record.scored["rewards"].tolist()        # the total: what the advantages were computed from
    parts = {name: values.tolist() for name, values in record.scored.get("parts", {}).items()}   # --reward's
    tokens = batch.completion_mask.sum(1).tolist()     # tokens, the end token included (completions/mean_length)
    prompts = []
    for p in range(min(PROMPTS_LOGGED, len(record.problems))):
        prompt_ids = batch.prompt_ids[p * G][batch.prompt_mask[p * G].bool()]   # without the left padding
        # the tokens decoded as they were: a chat template's special tokens stay visible
        prompts.append(run.tokenizer.decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    golds = [str(gold_answer(record.problems[p]["answer"])) for p in range(len(prompts))]
    return rows_of(step, prompts, golds, G, record.texts, rewards, parts, record.adv.tolist(), tokens,
                   batch.truncated.tolist())


def rows_of(step: int, prompts: list, golds: list, G: int, texts: list, rewards: list, parts: dict, advantages: list,
            tokens: list, cut: list) -> list[dict]:
    """completions.jsonl's rows, one per prompt of `prompts` (each with its gold answer): the G rewards of its group
    and its first COMPLETIONS_LOGGED completions. The other arguments are lists over the rollout's rows, a group's G
    rows contiguous: texts, rewards (the total), parts ({name: list}: each reward, unweighted), advantages, tokens
    (the end token included) and whether each was cut at --max-new-tokens."""
    return [{"step": step, "prompt": prompt, "gold": gold,
             "group_rewards": [float(r) for r in rewards[p * G:(p + 1) * G]],
             "completions": [{"text": texts[i], "reward": float(rewards[i]),
                              "rewards": {name: float(values[i]) for name, values in parts.items()},
                              "advantage": float(advantages[i]), "tokens": int(tokens[i]), "cut": bool(cut[i])}
                             for i in range(p * G, p * G + min(G, COMPLETIONS_LOGGED))]}
            for p, (prompt, gold) in enumerate(zip(prompts, golds))]


def truncation_warning(step: int, row: dict, args) -> str:
    return (f"warning: step {step}: more than half the completions were cut at --max-new-tokens {args.max_new_tokens} "
            f"for {STREAK} steps in a row ({100 * row['completions/clipped_ratio']:.0f}% now): a cut completion "
            "has no final answer for the reward to read. Raise --max-new-tokens, ask for shorter answers "
            "(--system-prompt), or leave cut completions out of the loss (--mask-truncated) or charge for length "
            "(--overlong-penalty); completions.jsonl shows them")


def no_signal_warning(step: int, row: dict, args) -> str:
    """With a mean reward of 1/2 or more (a task reward is 0 or 1) the groups agree on right answers, else on wrong
    ones: each needs its own advice."""
    what = ("the task is too easy for the model: use harder problems" if row["reward"] >= 0.5 else
            "read completions.jsonl: do the completions end in the format the reward reads (--reward, --chat-template, "
            "--system-prompt)? Else make the task easier, or raise --group-size or --temperature")
    return (f"warning: step {step}: every group's {args.group_size} rewards were equal for {STREAK} steps in a row "
            f"(mean reward {row['reward']:.2f}): no group has a signal, every advantage and the loss are 0 and "
            f"nothing is learned; {what}")


# name: (whether a metrics row shows it, the line that says so)
WARNINGS = {
    "truncation": (lambda row: row["completions/clipped_ratio"] > MOST_CUT, truncation_warning),
    # every group's rewards equal; with DAPO's filter that is also the step that makes no update (skipped)
    "no_signal": (lambda row: row["frac_reward_zero_std"] >= 1 or row.get("dynamic_sampling/skipped", 0) == 1,
                  no_signal_warning),
}


class CannotLearnWatch:
    """The warnings of a run that cannot learn: counts, for each of WARNINGS, the steps in a row whose metrics row
    shows it; when a streak reaches STREAK steps, writes one line (write: the progress bar's, so the bar stays
    whole) and marks that row `warning/<name>` = 1. Once per streak: a new streak warns again.

    run_dir: the run's directory, whose metrics.jsonl rows so far are replayed without a word (None: none). A resumed
    run's log is cut back to its checkpoint, so its streaks go on where they stood there and it warns on the steps an
    uninterrupted run does."""

    def __init__(self, args, write, run_dir: str | None = None):
        self.args, self.write = args, write
        self.streaks = {name: 0 for name in WARNINGS}
        for row in read_log(os.path.join(run_dir, "metrics.jsonl")) if run_dir else []:
            self.check(row, quiet=True)

    def check(self, row: dict, quiet: bool = False) -> dict:
        """A step's metrics row in; the warnings it fires out, as metrics ({"warning/truncation": 1.0}, or {})."""
        if "completions/clipped_ratio" not in row:     # step 0: the start model's evaluation, no rollout
            return {}
        fired = {}
        for name, (shows, line) in WARNINGS.items():
            self.streaks[name] = self.streaks[name] + 1 if shows(row) else 0
            if self.streaks[name] == STREAK:
                fired[f"warning/{name}"] = 1.0
                if not quiet:
                    self.write(line(row["step"], row, self.args))
        return fired


def show_completions(run_dir: str, count: int = 3, width: int = 72) -> list[tuple[str, str]]:
    """(label, text) lines of the run's summary: the first prompt of the last step in completions.jsonl and up to
    `count` of its completions, one line each, cut to `width` characters (newlines shown as \\n). None logged: []."""
    rows = read_log(os.path.join(run_dir, "completions.jsonl"))
    if not rows:
        return []
    row = rows[-len([r for r in rows if r["step"] == rows[-1]["step"]])]      # the last step's first prompt

    def quoted(text: str) -> str:
        text = json.dumps(text, ensure_ascii=False)
        return text if len(text) <= width else text[:width - 4] + '..."'
    lines = [("completions", f"step {row['step']}, its first prompt (completions.jsonl): {quoted(row['prompt'])}")]
    for c in row["completions"][:count]:
        lines.append(("", f"reward {c['reward']:.2f}, advantage {c['advantage']:+.2f}, {c['tokens']:>3} tokens"
                          f"{' (cut)' if c['cut'] else ''}: {quoted(c['text'])}"))
    return lines
