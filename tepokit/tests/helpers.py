"""Shared by the tests of train_small.py and tepokit: the micro configuration, running main() in-process,
reading logs, refusals in one line."""
import contextlib
import dataclasses
import inspect
import io
import itertools
import json
import os
import signal
import time
import sys
import subprocess
from pathlib import Path

import torch

import tepo
import train_small as ts
from tepokit.cli.flags import objective_config, parse_args
from tepokit.plumbing.report import Trackers
from tepokit.plumbing.rundir import save_checkpoint
from tepokit.core.step_settings import step_settings


REPO = str(Path(__file__).resolve().parents[2])      # the repository root
F64 = torch.float64


def assert_close(actual, expected, atol=1e-10, rtol=1e-9, msg=None):
    """torch.testing.assert_close in float64, for tensors and plain numbers alike."""
    actual = actual.detach().to(F64) if torch.is_tensor(actual) else torch.tensor(actual, dtype=F64)
    expected = expected.detach().to(F64) if torch.is_tensor(expected) else torch.tensor(expected, dtype=F64)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg)
SCRIPT = os.path.join(REPO, "train_small.py")


# A micro configuration: a 1-layer model of width 32, 2 prompts x 4 samples, easy problems (operands
# 1..2), a 40-step warm-up so that groups have mixed rewards and every objective really updates, and the
# entropy check on every step (the tests read it on every step).
MICRO = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--difficulty", "2", "--n-train", "60",
         "--n-test", "4", "--warmup-steps", "40", "--warmup-lr", "3e-3", "--warmup-batch", "16",
         "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "12", "--overlong-cache", "4",
         "--pass-k", "2", "--pass-k-problems", "2", "--entropy-check-rows", "4", "--reward", "lenient",
         "--lr", "1e-3", "--eval-every", "2", "--save-every", "1", "--entropy-check-every", "1"]

TIMING = ("timing/", "perf/", "memory/", "step_time", "flops/")


def run_main(argv):
    assert ts.main(argv) == 0


def read_rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def read_completions(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "completions.jsonl"))]


def warnings_of(rows):
    """{step: [names]} of the warnings a run's metrics.jsonl rows record."""
    return {r["step"]: sorted(k[len("warning/"):] for k in r if k.startswith("warning/"))
            for r in rows if any(k.startswith("warning/") for k in r)}


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def micro_run(model, tokenizer, args, objective, ref_model=None, lr=1e-3, recompute=True, **overrides):
    """A ts.Run around a model built in the test (no run directory, no task). recompute: old log-probs
    by a forward pass (batches made by hand have no sampler log-probs), or the sampler's."""
    args = dataclasses.replace(args, objective=objective)
    settings = dataclasses.replace(step_settings(args, model.config), recompute=recompute, sampler_logprobs=True)
    return ts.Run(args=args, cfg=tepo.config_for(objective, **overrides),
                  objective=tepo.OBJECTIVES[objective], device=torch.device("cpu"), run_dir="", lock=None,
                  identity={}, model=model, ref_model=ref_model, tokenizer=tokenizer,
                  optimizer=torch.optim.Adam(model.parameters(), lr=lr), train_set=None, test_set=None,
                  first_step=1, details_path=None,
                  settings=settings, trackers=Trackers([], "", {}))


FIRST_MINIBATCH = ("logprobs/first_minibatch_max_abs_log_ratio", "logprobs/first_minibatch_mean_abs_log_ratio")


def old_policy_and_update(run, batch, adv, plan, observe=None):
    """Steps 5 and 6 of rl_step on a given rollout: the old policy (ts.old_policy), then the update
    (ts.update_policy, with its observer). Returns (metrics, seen, old, loss_saw): the loss's metrics with the
    first mini-batch's log-ratio against the old log-probs (what the run logs from after_step.rollout_statistics),
    the old policy as the loss saw it, the old policy as computed before the update, and what the loss saw."""
    from tepokit.diagnostics.after_step import rollout_statistics
    old = ts.old_policy(run, batch, plan)
    losses, seen, loss_saw = ts.update_policy(run, batch, old, adv, plan, observe)
    record = ts.StepRecord(problems=None, batch=batch, texts=[], scored={}, adv=adv, keep=None, plan=plan, old=old,
                           seen=seen, loss_saw=loss_saw, losses=losses, clock=None)
    stats = rollout_statistics(run.model, record, run.settings)
    return {**losses, **{key: stats[key] for key in FIRST_MINIBATCH}}, seen, old, loss_saw


def hand_batch(vocab: int, rows: int, prompt: int, completion: int, seed: int = 0):
    """A rollout made by hand (train_small.Rollout): left-padded prompts and completions of different lengths;
    no row is truncated, and there are no sampler fields."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    for i in range(rows):
        prompt_mask[i, :i % 3] = 0                                   # left padding
        completion_mask[i, completion - i % 4:] = 0                  # right padding after the end
    return ts.Rollout(prompt_ids=torch.randint(1, vocab, (rows, prompt), generator=g), prompt_mask=prompt_mask,
                      completion_ids=torch.randint(1, vocab, (rows, completion), generator=g),
                      completion_mask=completion_mask, truncated=torch.zeros(rows, dtype=torch.bool))


def read_details(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "details.jsonl"))]


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Every k-subset of n samples (the first c right), the fraction that holds a right one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


def parse_outcome(argv):
    """(exit status or None if accepted, stderr lines) of parse_args, in-process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parse_args(ts.Args, argv)
            code = None
        except SystemExit as e:
            code = e.code
    return code, err.getvalue().splitlines()


def assert_refused_in_one_line(argv, *needles):
    code, lines = parse_outcome(argv)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("train_small.py: error: "), (argv, code, lines)
    for needle in needles:
        assert needle in lines[0], (argv, needle, lines)
    return lines[0]


IDENTITY = {"objective": "tepo", "model_shape": "m", "tokenizer": "t", "data": "d"}


def fake_run(run_dir, step=2, **args):
    """A run directory as train_small.py leaves it: config.json, checkpoint.pt (a tiny model) and the logs."""
    os.makedirs(run_dir, exist_ok=True)
    saved = ts.Args(**{"steps": 4, **args})
    cfg = objective_config(saved, {})
    identity = {**IDENTITY, "objective": saved.objective}
    json.dump({"args": dataclasses.asdict(saved), "objective_overrides": {}, "identity": identity,
               "objective_config": dataclasses.asdict(cfg)}, open(os.path.join(run_dir, "config.json"), "w"))
    model = torch.nn.Linear(3, 3)
    save_checkpoint(str(run_dir), model, torch.optim.Adam(model.parameters()), step, identity)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s}) + "\n" for s in range(step + 1))
    if saved.objective == "tepo":
        with open(os.path.join(run_dir, "details.jsonl"), "w") as f:
            f.writelines(json.dumps({"step": s}) + "\n" for s in range(1, step + 1))
    return str(run_dir)


def assert_whole_rows_without_duplicates(run_dir):
    text = Path(run_dir, "metrics.jsonl").read_text()
    assert text.endswith("\n")
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(len(steps))), steps


def start_process(argv, **env):
    return subprocess.Popen([sys.executable, SCRIPT, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})


def wait_until(condition, process, timeout=240):
    t0 = time.time()
    while not condition():
        assert process.poll() is None, f"the run ended before the awaited moment: {process.stderr.read()}"
        assert time.time() - t0 < timeout
        time.sleep(0.01)


def rows_in(run_dir):
    path = Path(run_dir, "metrics.jsonl")
    return path.read_text().count("\n") if path.exists() else 0


def strict_loads(text):
    """json.loads as strict parsers (JavaScript, jq, Go) read: NaN and Infinity are not JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def line_of(function, text: str) -> int:
    """The number of the first line of `function` that holds `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@contextlib.contextmanager
def signal_at(function, line: int, step: int, sig=signal.SIGTERM):
    """Send `sig` to this process once, when `function` reaches `line` with its local `step` equal to `step`."""
    sent = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and frame.f_locals.get("step") == step and not sent:
            sent.append(line)
            os.kill(os.getpid(), sig)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code is function.__code__ else None)
    try:
        yield sent
    finally:
        sys.settrace(None)


def make_model_dir(path, vocab_size: int, width: int = 64, layers: int = 2, special_tokens: tuple = (),
                   chat_template: str | None = None, extra_chars: str = "", max_positions: int = 256) -> str:
    """A Qwen2-architecture micro model with a WordLevel tokenizer of vocab_size entries (one token per character),
    saved; its end token <|endoftext|> only. special_tokens: more special tokens (a chat template's), given the ids
    after <unk>; chat_template: the tokenizer's template (None: none)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+-*/=#.,:?! \n" + extra_chars))
    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{t: i + 2 for i, t in enumerate(special_tokens)}}
    vocab.update({c: i + len(vocab) for i, c in enumerate(chars)})
    vocab.update({f"<t{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", padding_side="left",
                                        additional_special_tokens=list(special_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True, max_position_embeddings=max_positions, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
