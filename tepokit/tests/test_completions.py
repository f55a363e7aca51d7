"""completions.jsonl and the warnings of a run that cannot learn (tepokit/diagnostics/completions.py): every
objective's run writes the completions with their real prompts, rewards and advantages; a resumed run writes the
file and warns as an uninterrupted one; each warning fires on a run made to trigger it, once per streak, and the
default run says nothing; replayed over the committed logs, neither fires on the README's runs and both fire on
runs that cannot learn."""
import glob
import json
import os
from decimal import Decimal

import pytest
import torch

import tepo
import train_small as ts
from tepokit.cli.flags import parse_args
from tepokit.core.reward import REWARDS, format_prompt, gold_answer
from tepokit.diagnostics.completions import STREAK, CannotLearnWatch, logs_completions
from tepokit.plumbing.rundir import read_log
from tepokit.setup.task import load_task
from tepokit.tests.helpers import MICRO, REPO, read_completions, read_rows, run_main, warnings_of, without_timing


def comparable(rows):
    """Rows without timings and without logprobs/first_minibatch_*: in this run a resumed run's differ from an
    uninterrupted run's by ~1e-8 (so they did before completions.jsonl existed)."""
    return [{k: v for k, v in r.items() if not k.startswith("logprobs/first_minibatch")} for r in without_timing(rows)]


@pytest.mark.parametrize("objective", sorted(tepo.OBJECTIVES))
def test_every_objectives_run_writes_the_completions_as_they_were_scored(objective, workdir, capsys):
    """Steps 1 and 2 (every 2nd step, and step 1): the step's first 2 prompts as the tokenizer decodes them (the
    question and a newline), the gold answer, each completion's reward recomputed from its text, the advantage the
    objective computes from the group's logged rewards, the length within --max-new-tokens; the run's summary shows
    the last step's first prompt and three of its completions."""
    argv = [*MICRO, "--objective", objective, "--steps", "2", "--log-completions-every", "2", "--threads", "1",
            "--out", f"runs/completions_{objective}"]
    args = parse_args(ts.Args, argv)[0]         # before the run: afterwards --out holds one, and is refused
    run_main(argv)
    train, cfg = load_task(args)["train"], tepo.config_for(objective)
    rows = read_completions(args.out)
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    for step in (1, 2):
        problems = train.select(ts.prompts_for_step(step, len(train), args))
        for p, row in enumerate(r for r in rows if r["step"] == step):
            assert row["prompt"] == format_prompt(problems[p]["question"])
            assert row["gold"] == str(gold_answer(problems[p]["answer"]))
            assert len(row["group_rewards"]) == args.group_size and len(row["completions"]) == 4
            advantages = tepo.group_advantages(torch.tensor(row["group_rewards"]), args.group_size,
                                               cfg.advantage_scale, cfg.adv_eps)
            for c, reward, advantage in zip(row["completions"], row["group_rewards"], advantages.tolist()):
                assert set(c) == {"text", "reward", "rewards", "advantage", "tokens", "cut"}
                assert c["rewards"] == {"lenient": REWARDS["lenient"](c["text"], Decimal(row["gold"]))}
                length_cost = tepo.soft_overlong_punishment(torch.tensor([float(c["tokens"])]), args.max_new_tokens,
                                                            args.overlong_cache).item() if cfg.overlong_penalty else 0
                assert c["reward"] == reward == pytest.approx(c["rewards"]["lenient"] + length_cost)
                assert c["advantage"] == pytest.approx(advantage, abs=1e-6)
                assert 1 <= c["tokens"] <= args.max_new_tokens and (not c["cut"] or c["tokens"] == args.max_new_tokens)
    out = capsys.readouterr().out
    last = [r for r in rows if r["step"] == 2][0]
    assert f"  completions          step 2, its first prompt (completions.jsonl): {json.dumps(last['prompt'])}" in out
    for c in last["completions"][:3]:
        assert f"reward {c['reward']:.2f}, advantage {c['advantage']:+.2f}, {c['tokens']:>3} tokens" in out


def test_the_truncation_warning_fires_on_a_run_that_cuts_every_completion_and_a_resumed_run_repeats_it(workdir,
                                                                                                      capsys):
    """--max-new-tokens 2: most completions are cut, and none has a `#### n` (every reward 0): both warnings fire
    at step STREAK, once per streak, in one line each, recorded in metrics.jsonl and listed in the summary. A run
    stopped after step 3 and resumed replays its log's streaks: the same warnings on the same steps, and the same
    completions.jsonl (cut back to the checkpoint, then written again)."""
    argv = [*MICRO, "--objective", "grpo", "--steps", "7", "--max-new-tokens", "2", "--overlong-cache", "1",
            "--reward", "strict", "--log-completions-every", "3", "--threads", "1"]
    run_main([*argv, "--out", "runs/cut_full"])
    out = capsys.readouterr().out
    rows = read_rows("runs/cut_full")
    assert all(r["completions/clipped_ratio"] > 0.5 for r in rows[1:])   # a few end at once, with the end token
    assert warnings_of(rows) == {STREAK: ["no_signal", "truncation"]}
    lines = [line for line in out.splitlines() if "warning: " in line]
    assert len(lines) == 2, lines
    percent = 100 * rows[STREAK]["completions/clipped_ratio"]
    assert lines[0].endswith(f"warning: step {STREAK}: more than half the completions were cut at --max-new-tokens "
                             f"2 for {STREAK} steps in a row ({percent:.0f}% now): a cut completion has no final "
                             "answer for the reward to read. Raise --max-new-tokens, ask for shorter answers "
                             "(--system-prompt), or leave cut completions out of the loss (--mask-truncated) or charge "
                             "for length (--overlong-penalty); completions.jsonl shows them")
    assert f"  warnings             truncation at step {STREAK}, no_signal at step {STREAK}" in out
    logged = [c for r in read_completions("runs/cut_full") for c in r["completions"]]
    assert sum(c["cut"] for c in logged) > len(logged) / 2 and all(c["tokens"] == 2 for c in logged if c["cut"])

    run_main([*argv, "--out", "runs/cut_resumed", "--stop-after", "4"])
    assert [r["step"] for r in read_completions("runs/cut_resumed")] == [1, 1, 3, 3]
    with open("runs/cut_resumed/completions.jsonl", "a") as f:    # rows of a step after the checkpoint, as a
        f.write(json.dumps({"step": 5, "prompt": "killed before its checkpoint"}) + "\n")   # kill -9 leaves
    with open("runs/cut_resumed/checkpoint.pt", "rb") as f:
        assert torch.load(f, weights_only=True)["step"] == 4
    run_main(["--resume", "runs/cut_resumed"])
    assert comparable(read_rows("runs/cut_resumed")) == comparable(rows)
    assert read_completions("runs/cut_resumed") == read_completions("runs/cut_full")


def test_the_no_signal_warning_fires_when_every_group_samples_one_answer(workdir, capsys):
    """--temperature 0.001: each group's G completions are one and the same, so are their rewards: no group has a
    signal, and the warning says so at step STREAK and says to raise --temperature. --log-completions-every 0:
    completions.jsonl stays empty and the summary shows none."""
    run_main([*MICRO, "--objective", "grpo", "--steps", str(STREAK), "--temperature", "0.001",
              "--log-completions-every", "0", "--threads", "1", "--out", "runs/cold"])
    out = capsys.readouterr().out
    rows = read_rows("runs/cold")
    assert all(r["frac_reward_zero_std"] == 1 for r in rows[1:])
    assert warnings_of(rows)[STREAK] == ["no_signal"]
    line, = [line for line in out.splitlines() if "every group's" in line]
    assert f"warning: step {STREAK}: every group's 4 rewards were equal for {STREAK} steps in a row" in line
    assert "nothing is learned" in line and "--temperature" in line
    assert os.path.getsize("runs/cold/completions.jsonl") == 0 and "\n  completions " not in out


def test_the_default_run_says_nothing(workdir, capsys):
    """The default settings (the committed start model, 16 prompts x 8 samples, --max-new-tokens 24) for STREAK
    steps, long enough for a warning: none fires, none is printed; completions at step 1 and the last step's. The
    run stops after them as if interrupted (--stop-after): only the start model is evaluated."""
    run_main(["--stop-after", str(STREAK), "--log-completions-every", str(STREAK), "--pass-k-problems", "4",
              "--eval-every", "100", "--threads", "1", "--out", "runs/default"])
    assert warnings_of(read_rows("runs/default")) == {}
    assert "warning" not in capsys.readouterr().out
    assert [r["step"] for r in read_completions("runs/default")] == [1, 1, STREAK, STREAK]


def test_the_watch_fires_once_per_streak_and_a_replayed_log_goes_on_where_it_stood():
    """Synthetic rows: a streak of STREAK - 1 says nothing; the STREAK-th step fires, later steps of the same streak
    do not; a new streak fires again. Step 0 (no rollout) is not a step of a streak. A watch given a run directory
    replays its metrics.jsonl silently and fires where a watch that saw every row fires."""
    def row(step, cut=0.0, zero_std=0.0, reward=0.0):
        return {"step": step, "completions/clipped_ratio": cut, "frac_reward_zero_std": zero_std, "reward": reward}
    said = []
    watch = CannotLearnWatch(ts.Args(), said.append)
    assert watch.check({"step": 0, "eval/accuracy": 0.3}) == {}
    fired = [watch.check(row(s, cut=0.9)) for s in range(1, STREAK + 3)]        # one streak of STREAK + 2 steps
    assert fired == [{}] * (STREAK - 1) + [{"warning/truncation": 1.0}, {}, {}]
    assert watch.check(row(STREAK + 3, cut=0.5)) == {}                        # half is not more than half: it ends
    fired = [watch.check(row(s, cut=0.6)) for s in range(STREAK + 4, 2 * STREAK + 4)]   # a new streak
    assert fired[-1] == {"warning/truncation": 1.0} and fired[:-1] == [{}] * (STREAK - 1)
    assert len(said) == 2 and all(line.startswith("warning: step ") and "\n" not in line for line in said)
    # no signal: every group equal, or DAPO's filter dropped every group; a mean reward of 1/2 or more says
    # the task is too easy, a lower one says to look at the format
    for s in range(1, STREAK + 1):
        fired = watch.check(row(100 + s, zero_std=1.0 if s % 2 else 0.5, reward=0.9) | (
            {} if s % 2 else {"dynamic_sampling/skipped": 1.0}))
    assert fired == {"warning/no_signal": 1.0} and "the task is too easy" in said[-1]
    cold = CannotLearnWatch(ts.Args(), said.append)
    for s in range(1, STREAK + 1):
        cold.check(row(s, zero_std=1.0))
    assert "do the completions end in the format the reward reads" in said[-1]
    assert logs_completions(1, 10) and logs_completions(20, 10) and not logs_completions(15, 10)
    assert not any(logs_completions(step, 0) for step in range(1, 30))


def test_a_watch_given_a_run_directory_replays_its_log(tmp_path):
    def row(step):
        return {"step": step, "completions/clipped_ratio": 1.0, "frac_reward_zero_std": 0.0, "reward": 0.0}
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in [{"step": 0}] + [row(s) for s in range(1, STREAK)])
    said = []
    watch = CannotLearnWatch(ts.Args(), said.append, str(tmp_path))
    assert said == [] and watch.check(row(STREAK)) == {"warning/truncation": 1.0} and len(said) == 1


# The committed logs of the README's runs (notebooks/logs/COMMANDS.md): the default command (tepo__1, grpo__1 of
# --compare and five seeds of it), --demo, --task hidden-type (TEPO and GRPO without its KL term), and grpo and tepo
# of the standard regime (the default settings for 100 steps); and five runs that cannot learn: an entropy bonus of
# 1.0 makes the policy babble until nearly every completion is cut and every reward is 0.
README_RUNS = ["tepo__1", "grpo__1", "main_command_2026-11-25/tepo__*", "demo_2026-11-26/tepo__*",
               "hidden_type_2026-11-25/tepo__*", "hidden_type_2026-11-25/grpo_beta=0__*",
               "standard_regime_2026-11-24/grpo__*", "standard_regime_2026-11-24/tepo__*"]
BROKEN_RUNS = "hidden_type_2026-11-25/grpo_beta=0_entropy_coef=1.0__*"


def warnings_replayed(pattern, longest=None):
    """{run directory: {step: [names]}} of the warnings a watch fires over each committed run's metrics.jsonl;
    longest: a dict that gets the longest streak of each warning over them all, and the largest share cut."""
    out, longest = {}, {} if longest is None else longest
    for run_dir in sorted(glob.glob(os.path.join(REPO, "notebooks", "logs", pattern))):
        watch, fired = CannotLearnWatch(ts.Args(), lambda line: None), []
        for r in read_log(os.path.join(run_dir, "metrics.jsonl")):
            fired.append({"step": r["step"], **watch.check(r)})
            for name, streak in watch.streaks.items():
                longest[name] = max(longest.get(name, 0), streak)
            longest["cut"] = max(longest.get("cut", 0), r.get("completions/clipped_ratio", 0))
        out[run_dir] = warnings_of(fired)
    return out


def test_the_readmes_runs_never_warn_and_runs_that_cannot_learn_do():
    """docs/metrics.md's numbers: on the README's 30 runs, no warning, at most 4% cut, at most 3 steps in a row
    without a signal; the five runs that cannot learn warn of both, at these steps."""
    longest = {}
    readme = {run: fired for pattern in README_RUNS for run, fired in warnings_replayed(pattern, longest).items()}
    assert len(readme) == 30 and all(fired == {} for fired in readme.values()), readme
    assert longest["cut"] <= 0.04 and longest["no_signal"] == 3 and longest["truncation"] == 0
    broken = warnings_replayed(BROKEN_RUNS)
    first = {name: sorted(min(step for step, names in fired.items() if name in names) for fired in broken.values())
             for name in ("truncation", "no_signal")}
    assert first == {"truncation": [22, 26, 27, 28, 33], "no_signal": [37, 41, 43, 48, 51]}     # docs/metrics.md
