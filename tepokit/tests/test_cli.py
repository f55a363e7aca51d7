"""tepokit/cli/flags.py: every flag validated in one line, --help, --regime, the rules of --resume."""
import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tepo
import train_small as ts
import tepokit.cli.helptext
import tepokit.cli.validation
from tepokit.cli.flags import DEMO, REGIMES, build_parser, objective_config, parse_args, saved_settings
from tepokit.cli.validation import field_kinds
from tepokit.setup.model import START_MODEL_DIR, committed_start_model
from tepokit.tests.helpers import SCRIPT, parse_outcome, assert_refused_in_one_line, fake_run


def test_bad_flag_in_a_real_process_and_offline_hub():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}   # fail fast instead of waiting for the network
    for argv in (["--objective", "nope"], ["--model", "some-org/some-model", "--steps", "1"]):
        out = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=180,
                             env=env, cwd=os.path.dirname(SCRIPT))
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr


def test_objective_flags_cover_every_config_field():
    parser = build_parser(ts.Args)
    flags = {a.dest for a in parser._actions}
    import dataclasses
    assert {f.name for f in dataclasses.fields(tepo.ObjectiveConfig)} <= flags
    args, overrides = parse_args(ts.Args, ["--objective", "tepo", "--eps-low", "0.01", "--dual-clip-c", "none",
                                     "--no-dynamic-sampling", "--kl-target", "ref"])
    cfg = objective_config(args, overrides)
    assert cfg.eps_low == 0.01 and cfg.dynamic_sampling is False and cfg.kl_target == "ref"
    assert cfg.eps_high == tepo.PAPER_DEFAULTS["tepo"].eps_high


def test_regime_is_a_preset_that_explicit_flags_override():
    assert parse_args(ts.Args, ["--regime", "collapse"])[0].lr == REGIMES["collapse"]["lr"] != ts.Args.lr
    assert parse_args(ts.Args, ["--regime", "collapse", "--lr", "5e-5"])[0].lr == 5e-5
    assert parse_args(ts.Args, [])[0].lr == ts.Args.lr and parse_args(ts.Args, [])[0].regime == "standard"


def test_demo_is_a_preset_from_the_committed_start_model_that_explicit_flags_override():
    """--demo sets its settings (and only those), takes the committed start model whatever the RL seed, and a
    flag given explicitly wins over it."""
    demo = parse_args(ts.Args, ["--demo", "--seed", "4"])[0]
    assert {k: getattr(demo, k) for k in DEMO} == DEMO and demo.steps != ts.Args.steps
    assert dataclasses.replace(demo, **{k: getattr(ts.Args, k) for k in DEMO}, demo=False) == ts.Args(seed=4)
    assert committed_start_model(demo) == START_MODEL_DIR
    assert parse_args(ts.Args, ["--demo", "--steps", "12"])[0].steps == 12
    assert parse_args(ts.Args, ["--demo", "--regime", "collapse"])[0].lr == REGIMES["collapse"]["lr"]


def non_hidden_flags():
    """(field name, kind) of every flag, Args and objective settings, except the hidden --stop-after."""
    return [(name, kind) for name, (kind, _) in field_kinds(ts.Args).items() if name != "stop_after"]


FUZZ_NUMBERS = ["0", "-1", "-0.5", "nan", "inf", "-inf", "1e300", "99999999999999999999", "x", ""]


def test_fuzz_every_flag_with_hostile_values(tmp_path, monkeypatch):
    """Every flag with zero, negative numbers, nan, inf, huge numbers and a wrong type: refused in one
    line naming the flag, or accepted; nothing is created. nan and inf are refused for every float flag."""
    monkeypatch.chdir(tmp_path)
    accepted = []
    for name, kind in non_hidden_flags():
        flag = tepokit.cli.validation.flag(name)
        for value in ["3", "maybe"] if kind == "bool" else FUZZ_NUMBERS:
            argv = [f"{flag}={value}"]
            code, lines = parse_outcome(argv)
            if code is None:
                assert all(line.startswith("train_small.py: warning: ") for line in lines), (argv, lines)
                accepted.append(argv)
                must_refuse = (kind == "float" and value in ("nan", "inf", "-inf")
                               or kind == "int" and value in ("nan", "inf", "1e300", "99999999999999999999", "x"))
                assert not must_refuse, argv
            else:
                assert code == 2 and len(lines) == 1 and lines[0].startswith("train_small.py: error: "), lines
                assert flag in lines[0], (argv, lines)
    assert ["--lr=1e300"] in accepted and ["--out=x"] in accepted      # huge but meaningful; a plain path
    assert os.listdir(tmp_path) == []


HOSTILE = [
    ["--overlong-cache", "30", "--max-new-tokens", "10"], ["--n-embd", "30", "--n-head", "4"],
    ["--arch", "qwen2", "--n-embd", "6", "--n-head", "2"], ["--mini-batches", "5", "--prompts-per-step", "4"],
    ["--micro-batch-size", "9", "--prompts-per-step", "2", "--group-size", "4", "--mini-batches", "1"],
    ["--difficulty", "1", "--ops", "+"], ["--ops=+-+"], ["--ops=/"], ["--compare", "grpo,grpo"],
    ["--compare", "grpo,"], ["--compare="], ["--compare", "grpo,tepo", "--baseline", "dapo"],
    ["--bench", "--compare", "grpo,tepo"], ["--clip-cov-lb", "6"], ["--clip-cov-ratio", "2"],
    ["--seed", "2147483647", "--seeds", "2"], ["--dual-clip-c", "1"], ["--norm-constant=-1"],
    ["--model", "a b"], ["--model", "./missing"], ["--dataset", "missing.jsonl"], ["--resume", "missing"],
    ["--steps"], ["--no-such-flag"], ["--dry-run=yes"], ["--lr", "1e-4", "--lr", "nan"], ["--objective", "PPO"],
    ["--threads", "100000"], ["--warmup-batch", "0"], ["--pass-k-problems", "0"], ["--n-layer", "-1"],
    ["--n-head", "0"], ["--entropy-check-rows", "-1"], ["--target-accuracy", "1.5"], ["--sft-noise", "-0.1"],
] + ([] if torch.cuda.is_available() else [["--device", "cuda"]])


@pytest.mark.parametrize("argv", HOSTILE, ids=" ".join)
def test_hostile_combinations_are_refused_in_one_line(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_refused_in_one_line(argv)
    assert os.listdir(tmp_path) == []


def test_refusals_name_the_flag_the_value_and_what_is_valid():
    assert_refused_in_one_line(["--n-head", "0"], "--n-head", "'0'", "an integer >= 1")
    assert_refused_in_one_line(["--overlong-cache", "30"], "--overlong-cache", "30", "1..24")
    assert_refused_in_one_line(["--eps-low=-0.1"], "--eps-low", "-0.1", ">= 0")
    assert_refused_in_one_line(["--clip-cov-lb", "6"], "--clip-cov-lb", "--clip-cov-ub (5.0)")
    assert_refused_in_one_line(["--aggregation", "median"], "median", "seq-mean-token-mean")
    assert_refused_in_one_line(["--objective", "nope"], "nope", "grpo", "tepo")
    assert_refused_in_one_line(["--micro-batch-size", "9", "--prompts-per-step", "2", "--group-size", "4",
                                "--mini-batches", "1"], "--micro-batch-size", "up to 8")


def test_settings_the_objective_does_not_read_are_warned_about():
    code, lines = parse_outcome(["--objective", "grpo", "--block-size", "8", "--kl-mode", "hard", "--eps-high", "0.3"])
    assert code is None and len(lines) == 2, lines
    assert "--block-size" in lines[0] and "grpo" in lines[0] and "mpo" in lines[0]
    assert "--kl-mode" in lines[1] and "tepo" in lines[1]
    # in --compare, a setting read by one of the compared objectives is not ignored
    assert parse_outcome(["--compare", "grpo,mpo", "--block-size", "8"]) == (None, [])


def test_bf16_with_the_samplers_old_logprobs_is_warned_about_in_one_line():
    """Allowed, but said: the later optimizer steps would clip on bf16 rounding. Not said when nothing
    rounds (fp32), when they are recomputed (bf16's default), or when there is no later optimizer step."""
    code, lines = parse_outcome(["--precision", "bf16", "--no-recompute-old-logprobs"])
    assert code is None and len(lines) == 1 and "warning" in lines[0] and "3e-4" in lines[0], lines
    for quiet in (["--no-recompute-old-logprobs"], ["--precision", "bf16"],
                  ["--precision", "bf16", "--no-recompute-old-logprobs", "--mini-batches", "1"]):
        assert parse_outcome(quiet) == (None, []), quiet
    assert parse_outcome(["--precision", "bf16", "--no-recompute-old-logprobs", "--mini-batches", "1",
                          "--epochs", "2"])[1] == lines


def test_no_fast_refuses_the_switches_that_ask_for_a_fast_twin_in_one_line():
    """--no-fast is the plain path: a finer switch that names a twin is refused (the default --sampler loop is
    not: it refines --fast); the same switches set to their plain value are accepted."""
    assert_refused_in_one_line(["--no-fast", "--cuda-graphs", "on"], "--cuda-graphs", "'on'", "--no-fast")
    assert_refused_in_one_line(["--no-fast", "--no-recompute-old-logprobs"], "--recompute-old-logprobs", "--no-fast")
    assert_refused_in_one_line(["--no-fast", "--sampler", "loop"], "--sampler", "'loop'", "generate")
    for accepted in (["--no-fast"], ["--no-fast", "--sampler", "generate", "--cuda-graphs", "off",
                                     "--recompute-old-logprobs"], ["--cuda-graphs", "on", "--sampler", "loop"]):
        assert parse_outcome(accepted) == (None, []), accepted
    assert parse_args(ts.Args, ["--no-fast"])[0].fast is False and ts.Args().fast is True


def test_real_processes_refuse_in_one_line_and_create_nothing(tmp_path):
    processes = [subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, cwd=tmp_path)      # at once: the suite waits for the slowest
                 for argv in (["--n-head", "0"], ["--lr=nan"], ["--n-embd", "30", "--n-head", "4"], ["--bogus"])]
    for process in processes:
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert "Traceback" not in stderr and stdout == ""
    assert os.listdir(tmp_path) == []


def test_accepted_values_pass_the_dry_run(tmp_path, monkeypatch):
    if "args.dry_run" not in Path(SCRIPT).read_text():
        pytest.skip("--dry-run is not implemented yet")
    monkeypatch.chdir(tmp_path)
    for argv in (["--lr=1e300"], ["--temperature", "1e-300"], ["--eps-high", "1e300"], ["--steps", "2147483647"],
                 ["--objective", "grpo", "--block-size", "8"], ["--micro-batch-size", "64"], ["--n-layer", "1"]):
        assert ts.main([*argv, "--dry-run"]) == 0, argv


def test_help_tells_the_truth():
    parser = build_parser(ts.Args)
    text = parser.format_help()
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    assert {a.dest for a in shown} == {name for name, _ in non_hidden_flags()}     # every field, --stop-after hidden
    assert "--stop-after" not in text
    for action in shown:        # every flag has its own help text, not its name
        assert action.help and action.help.split(" (default")[0] not in (action.dest, action.dest.replace("_", "-"))
        assert action.help.lower().count("default") <= 1, action.help
    assert "default: None" not in text and "(default: None)" not in text and "None" not in text
    modules = [tepo, ts, *(m for name, m in sys.modules.items() if name.startswith("tepokit."))]
    python_names = {n for m in modules for n in dir(m) if n.isupper() and len(n) > 3}
    assert not [n for n in python_names if n in text] and not re.search(r"\b(tepo|ts)\.(?!py)", text)
    beta = next(a.help for a in shown if a.dest == "beta")
    assert "paper value" in beta and "0.04 (grpo)" in beta and "1 (kl_cov, tepo)" in beta
    block = next(a.help for a in shown if a.dest == "block_size")
    assert "4 (mpo)" in block and "grpo" not in block          # only the objectives that read it
    assert "(default: 200)" in next(a.help for a in shown if a.dest == "steps")


def help_examples(text: str) -> list[str]:
    """The examples of --help, one line each (a line ending in a backslash goes on in the next)."""
    block = text[text.index("\nexamples:\n"):].split("\n\n")[0]
    return block.replace("\\\n", " ").splitlines()[2:]


def test_help_groups_every_flag_once_and_its_examples_are_valid_command_lines():
    """--help has the groups common flags, task and model, objective, run control, experiments, in that order,
    after the examples; every flag is in exactly one of them (also in the printed text), a few where a reader looks
    for them; a topic group names its flags that are in common flags; the examples are command lines that parse."""
    parser = build_parser(ts.Args)
    groups = {g.title: g for g in parser._action_groups if g.title in tepokit.cli.helptext.HELP_GROUPS}
    assert list(groups) == ["common flags", "task and model", "objective", "run control", "experiments"]
    flags = {tepokit.cli.validation.flag(name) for name, _ in non_hidden_flags()}
    owners = {flag: [title for title, g in groups.items() for a in g._group_actions if flag in a.option_strings]
              for flag in flags}
    assert {flag: titles for flag, titles in owners.items() if len(titles) != 1} == {}
    placed = {"--demo": "common flags", "--objective": "common flags", "--seed": "common flags",
              "--steps": "common flags", "--resume": "common flags", "--compare": "common flags",
              "--model": "common flags", "--dataset": "common flags", "--threads": "common flags",
              "--n-layer": "task and model", "--warmup-steps": "task and model", "--regime": "objective",
              "--lr": "objective", "--eps-high": "objective", "--kl-cov-ratio": "objective",
              "--eval-every": "run control", "--device": "run control", "--target-accuracy": "experiments",
              "--seeds": "experiments", "--bench": "experiments"}
    assert {flag: owners[flag][0] for flag in placed} == placed
    text = parser.format_help()
    headers = [text.index("\nexamples:\n")] + [text.index(f"\n{title}:\n") for title in groups] + [len(text)]
    assert headers == sorted(headers)
    for flag, (title,) in owners.items():       # printed under its own header, and under no other
        k = list(groups).index(title) + 1
        shown_in = [j for j in range(6) if re.search(rf"\n  {flag}[ ,\n]", text[headers[j]:headers[j + 1]])]
        assert shown_in == [k], (flag, shown_in)
    task_and_model = text[headers[2]:headers[3]]
    assert "In common flags, above: --task, --model, --dataset." in task_and_model
    examples = help_examples(text)
    assert any("python -m tepokit.tools.plot runs/<run>" in line for line in examples)
    assert any(line.strip().startswith("python train_small.py --resume runs/<run>") for line in examples)
    runnable = [line.split("#")[0].split()[2:] for line in examples
                if line.strip().startswith("python train_small.py") and "<" not in line]
    assert len(runnable) >= 5 and ["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", "openai/gsm8k",
                                   "--max-new-tokens", "256"] in runnable
    for argv in runnable:
        assert parse_outcome(argv)[0] is None, argv               # accepted: no exit


def test_help_shows_the_examples_and_the_common_flags_first(monkeypatch):
    """A newcomer reads the examples, then the flags most runs need, on the first screen of a terminal 100 columns
    wide: before any other group, and each common flag within the first 45 lines."""
    monkeypatch.setenv("COLUMNS", "100")          # argparse wraps to the terminal's width
    text = build_parser(ts.Args).format_help()
    lines = text.splitlines()
    assert lines[0] == "usage: python train_small.py [options]"
    titles = [line[:-1] for line in lines if re.fullmatch(r"[a-z][a-z ]*:", line)]
    assert titles == ["examples", "common flags", "task and model", "objective", "run control", "experiments"]
    for name in tepokit.cli.helptext.COMMON_FLAGS:
        flag = tepokit.cli.validation.flag(name)
        row = next(i for i, line in enumerate(lines) if re.match(rf"  {flag}( |,|$)", line))
        assert row < 45, (name, row)
    assert max(len(line) for line in lines[:lines.index("common flags:")]) <= 100     # the examples fit


def test_every_field_is_one_flag_shown_once():
    """Every field of Args and of tepo.ObjectiveConfig is one flag of the parser, printed once by --help (the
    switches with their --no- form); --stop-after, for the tests of --resume, is not printed."""
    parser = build_parser(ts.Args)
    text = parser.format_help()
    options = [option for a in parser._actions for option in a.option_strings]
    assert len(options) == len(set(options))
    fields = [f.name for f in dataclasses.fields(ts.Args)] + [f.name for f in dataclasses.fields(tepo.ObjectiveConfig)]
    assert len(fields) == len(set(fields))
    for name in fields:
        flag = tepokit.cli.validation.flag(name)
        assert options.count(flag) == 1, flag
        printed = len(re.findall(rf"^  {flag}[ ,\n]", text, flags=re.MULTILINE))
        assert printed == (0 if name == "stop_after" else 1), (flag, printed)


def test_help_of_a_preset_names_every_setting_it_sets_with_its_value():
    """--demo, --regime, --task and --bench-shape say what they set, from the presets themselves."""
    from tepokit.cli.flags import BENCH_SHAPES, DEMO_HIDDEN_TYPE, TASKS
    helps = {a.dest: " ".join(a.help.split()) for a in build_parser(ts.Args)._actions}
    said = {"demo": [DEMO, DEMO_HIDDEN_TYPE], "regime": [REGIMES["collapse"]], "task": [TASKS["hidden-type"]],
            "bench_shape": [BENCH_SHAPES["gpt2-small"]]}
    for name, presets in said.items():
        for preset in presets:
            assert preset and all(f"{tepokit.cli.validation.flag(k)} {v}" in helps[name] for k, v in preset.items()), \
                (name, preset, helps[name])
        assert "flags given explicitly win" in helps[name]
    assert helps["demo"].index(" ".join(f"{tepokit.cli.validation.flag(k)} {v}" for k, v in DEMO.items())) \
        < helps["demo"].index("hidden-type")
    assert "collapse sets --lr 0.0003" in helps["regime"] and "standard sets" not in helps["regime"]


def test_help_speaks_of_the_users_machine_not_ours():
    """No help text speaks of one particular machine (ours): --threads says what to set it to, and its default."""
    parser = build_parser(ts.Args)
    text = " ".join(parser.format_help().split()).lower()
    for phrase in ("the machine is shared", "this machine", "our machine", " our ", "(ours", " ours,", " here"):
        assert phrase not in text, phrase
    threads = next(a.help for a in parser._actions if a.dest == "threads")
    assert "cores" in threads and threads.endswith(f"(default: {ts.Args.threads})"), threads


def test_resume_refuses_flags_that_change_what_is_computed(tmp_path):
    run_dir = fake_run(tmp_path / "run")
    line = assert_refused_in_one_line(["--resume", run_dir, "--lr", "5", "--objective", "dapo", "--eps-high", "0.3"],
                                      "--lr 5.0", "--objective 'dapo'", "--eps-high 0.3")
    assert "--threads" not in line
    assert_refused_in_one_line(["--resume", run_dir, "--out", str(tmp_path / "elsewhere")], "--out")
    # the saved value, run-only flags and --steps are fine
    args, overrides = parse_args(ts.Args, ["--resume", run_dir, "--objective", "tepo", "--eps-high", "0.0004",
                                     "--threads", "1", "--steps", "9"])
    assert (args.objective, args.steps, args.threads, args.out, overrides) == ("tepo", 9, 1, run_dir, {})
    assert parse_args(ts.Args, ["--resume", run_dir])[0].steps == 4                 # the saved length
    assert_refused_in_one_line(["--resume", run_dir, "--steps", "1"], "--steps", ">= 2")   # below the checkpoint
    assert_refused_in_one_line(["--resume", run_dir, "--compare", "grpo,tepo"], "--resume", "--compare")
    # a fresh run may not overwrite a run directory that holds a checkpoint
    assert_refused_in_one_line(["--out", run_dir], "--out", f"--resume {run_dir}")


def test_saved_settings_are_kept_on_resume_with_the_run_only_fields_given():
    saved_args = ts.Args(objective="grpo", lr=3e-4, steps=10, threads=2)
    saved = {"args": dataclasses.asdict(saved_args), "objective_overrides": {"beta": 0.1}}
    cli = ts.Args(resume="r", threads=1, steps=20, lr=3e-4)
    args, overrides = saved_settings(cli, {}, {"resume", "threads", "steps", "lr"}, saved, checkpoint_step=7)
    assert (args.objective, args.lr, args.threads, args.steps, args.out, args.resume) == ("grpo", 3e-4, 1, 20, "r", "r")
    assert overrides == {"beta": 0.1}


@pytest.mark.parametrize("given, refused, value", [(["--prompts-per-step", "1"], "--mini-batches", 2),
                                                   (["--max-new-tokens", "1"], "--overlong-cache", 6)])
def test_a_default_that_a_given_flag_rules_out_is_said_to_be_a_default(given, refused, value):
    line = assert_refused_in_one_line(given, f"argument {refused}: invalid value {value}, its default (the flag was "
                                             "not given); choose an integer in 1..1")
    explicit = assert_refused_in_one_line([*given, refused, str(value)], f"argument {refused}: invalid value {value};")
    assert "default" not in explicit and line != explicit


def test_resume_keeps_the_runs_cache_dir_unless_it_is_given_again():
    """The resume command a run prints is --resume <dir> alone: the run's --cache-dir comes from its config.json,
    so the resumed run finds its warm-up model instead of warming up again into runs/cache."""
    saved = {"args": dataclasses.asdict(ts.Args(steps=10, cache_dir="/shared/cache")), "objective_overrides": {}}
    kept, _ = saved_settings(ts.Args(resume="r"), {}, {"resume"}, saved, checkpoint_step=4)
    given, _ = saved_settings(ts.Args(resume="r", cache_dir="mine"), {}, {"resume", "cache_dir"}, saved, 4)
    assert (kept.cache_dir, given.cache_dir) == ("/shared/cache", "mine")


def test_hidden_type_task_is_a_preset_recorded_in_the_args_with_its_own_demo():
    """--task hidden-type sets its preset (and only that), takes its committed start model, and flags win;
    --demo with it is the short classroom run of that task."""
    from tepokit.cli.flags import DEMO_HIDDEN_TYPE, TASKS
    from tepokit.setup.model import HIDDEN_TYPE_START_MODEL_DIR
    preset = TASKS["hidden-type"]
    args = parse_args(ts.Args, ["--task", "hidden-type", "--seed", "3"])[0]
    assert {k: getattr(args, k) for k in preset} == preset and args.task == "hidden-type"
    assert dataclasses.replace(args, **{k: getattr(ts.Args, k) for k in preset}, task="arith") == ts.Args(seed=3)
    assert committed_start_model(args) == HIDDEN_TYPE_START_MODEL_DIR
    assert parse_args(ts.Args, ["--task", "hidden-type", "--steps", "7"])[0].steps == 7
    demo = parse_args(ts.Args, ["--task", "hidden-type", "--demo"])[0]
    assert {k: getattr(demo, k) for k in DEMO_HIDDEN_TYPE} == DEMO_HIDDEN_TYPE
    assert demo.difficulty == preset["difficulty"]
    assert committed_start_model(demo) == HIDDEN_TYPE_START_MODEL_DIR
    assert committed_start_model(dataclasses.replace(args, majority=0.6)) is None


def test_entropy_coef_is_refused_with_the_trl_engine_before_anything_is_created(tmp_path):
    assert_refused_in_one_line(["--engine", "trl", "--entropy-coef", "0.1", "--out", str(tmp_path / "run")],
                               "--entropy-coef", "--engine tepo")
    assert not (tmp_path / "run").exists()
