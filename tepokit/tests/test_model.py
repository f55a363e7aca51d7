"""tepokit/setup/model.py: the built-in tokenizer, loading a model (end tokens, dropout off), the warm-up cache
(keyed by the data and the tokenizer, written once under a lock, never taken half-written)."""
import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import train_small as ts
from tepokit.setup import model as model_module
from tepokit.cli.flags import parse_args
from tepokit.core.forward import completion_logits
from tepokit.setup.model import (START_MODEL_DIR, WARMUP_FILES, build_char_tokenizer, build_tiny_model,
                                  builtin_tokenizer, committed_start_model, is_complete_warmup, load_policy,
                                  prepare_start_model, sft_batch, warmup_cache_dir)
from tepokit.core.forward import eos_ids_of
from tepokit.plumbing.rundir import lock_file
from tepokit.setup.task import load_task
from tepokit.core.reward import format_prompt
from tepokit.tests.helpers import MICRO, REPO, SCRIPT, hand_batch, micro_run, old_policy_and_update, wait_until


def test_char_tokenizer_round_trip_and_pad_is_eos():
    tok = build_char_tokenizer(["Ann has 3 pens.\n#### 3"])
    text = "Ann has 3 pens.\n3+4=7\n#### 7"
    ids = tok(text).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"


def test_stopping_on_every_end_token_of_the_model(tmp_path):
    """A model whose generation config names two end tokens (as Qwen2.5-Instruct: <|im_end|> and
    <|endoftext|>) stops on both, although its tokenizer names one: a completion ending in the
    second is masked after it and not counted as truncated."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config
    tok = build_char_tokenizer(["ab"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, tok.eos_token_id])
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tokenizer = load_policy(str(tmp_path), ts.Args(), torch.device("cpu"))
    assert tokenizer.eos_token_id != im_end
    assert sorted(eos_ids_of(loaded)) == sorted([im_end, tokenizer.eos_token_id])
    a = tokenizer.convert_tokens_to_ids("a")
    ids = torch.tensor([[a, a, im_end, a, a], [a, a, a, a, a]])
    assert ts.completion_mask(ids, eos_ids_of(loaded)).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_dropout_settings_are_off_also_in_train_mode_with_checkpointing(tmp_path):
    """A config whose attention reads the float `attention_dropout` (Qwen2), set to 0.5: after
    load_policy the update's first micro-batch is exactly on-policy in train() mode with gradient
    checkpointing; without switching the float settings off it is not."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    tok = build_char_tokenizer(["abc 0123456789"])
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.5,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    args = ts.Args(gradient_checkpointing=True, group_size=4, prompts_per_step=2, mini_batches=2, max_new_tokens=6)
    batch = hand_batch(len(tok), rows=8, prompt=4, completion=6)
    # control: as loaded by transformers, train() mode applies the dropout: two forwards differ
    raw = AutoModelForCausalLM.from_pretrained(tmp_path).train()
    first, second = (completion_logits(raw, batch, torch.arange(8), args.precision, prompt_once=False)  # checkpointing
                     for _ in range(2))
    assert (first - second).abs().max() > 1e-3
    model, tokenizer = load_policy(str(tmp_path), args, torch.device("cpu"))
    assert model.config.attention_dropout == 0.0 and model.is_gradient_checkpointing
    assert all(v == 0.0 for m in model.modules() for k, v in vars(m).items() if "dropout" in k
               and isinstance(v, float))
    run = micro_run(model, tokenizer, args, "grpo", beta=0.0)
    adv, keep = torch.randn(8), torch.ones(8, dtype=torch.bool)
    plan = ts.minibatch_plan(keep, args, run.settings.rows_per_forward)
    metrics, _, _, _ = old_policy_and_update(run, batch, adv, plan)
    assert metrics["logprobs/first_minibatch_max_abs_log_ratio"] == 0.0


def test_cache_dir_flag_places_and_prints_the_warm_up_cache(tmp_path, capsys):
    args = ts.Args(cache_dir=str(tmp_path / "my-cache"), n_train=20, n_test=5)
    task = load_task(args)
    cache = warmup_cache_dir(args, task, builtin_tokenizer(task))
    assert cache.startswith(str(tmp_path / "my-cache" / "warmup-"))
    assert warmup_cache_dir(dataclasses.replace(args, cache_dir="elsewhere"), task,
                            builtin_tokenizer(task)).endswith(os.path.basename(cache))
    os.makedirs(cache)
    for name in WARMUP_FILES:
        Path(cache, name).write_text("{}")
    assert prepare_start_model(args, task, torch.device("cpu")) == cache
    assert cache in capsys.readouterr().out


def write_jsonl(path, n=12):
    path.write_text("".join(json.dumps({"question": f"What is {i} plus 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(n)))
    return str(path)


def test_warm_up_cache_is_keyed_by_the_data_and_the_tokenizer(tmp_path):
    """The built-in task and a JSONL data set (same settings otherwise) get different entries; so do
    the same data with another tokenizer, and two JSONL files differing in one answer."""
    builtin = ts.Args(cache_dir=str(tmp_path), n_train=20, n_test=5)
    jsonl = dataclasses.replace(builtin, dataset=write_jsonl(tmp_path / "a.jsonl"))
    edited = tmp_path / "b.jsonl"
    edited.write_text((tmp_path / "a.jsonl").read_text().replace("#### 5", "#### 6"))
    other = dataclasses.replace(builtin, dataset=str(edited))
    dirs = set()
    for args in (builtin, jsonl, other):
        task = load_task(args)
        dirs.add(warmup_cache_dir(args, task, builtin_tokenizer(task)))
    task = load_task(builtin)
    dirs.add(warmup_cache_dir(builtin, task, build_char_tokenizer(["only these characters"])))
    assert len(dirs) == 4
    assert warmup_cache_dir(builtin, task, builtin_tokenizer(task)) in dirs       # the key is deterministic


WARM = [*MICRO, "--warmup-steps", "60"]
WARM_SCRIPT = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import train_small as ts; "
               "from tepokit.cli.flags import parse_args; from tepokit.setup.model import prepare_start_model; "
               "from tepokit.setup.task import load_task; args, _ = parse_args(ts.Args, sys.argv[2:]); "
               "print('entry', prepare_start_model(args, load_task(args), torch.device('cpu')), flush=True)")


def test_two_processes_warming_the_same_entry_both_succeed_and_it_is_written_once(tmp_path):
    """Both processes start while the entry's lock is held (here by the test), so they really contend:
    both wait; then one warms up and writes the entry, the other waits for it and finds it whole."""
    args, _ = parse_args(ts.Args, [*WARM, "--cache-dir", str(tmp_path / "cache")])
    task = load_task(args)
    cache = warmup_cache_dir(args, task, builtin_tokenizer(task))
    os.makedirs(tmp_path / "cache")
    held = lock_file(cache + ".lock", "the test's hold")
    outs = [tmp_path / f"out{i}.txt" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", WARM_SCRIPT, REPO, *WARM, "--cache-dir", str(tmp_path / "cache")],
                              stdout=open(out, "w"), stderr=subprocess.STDOUT) for out in outs]
    for proc, out in zip(procs, outs):
        wait_until(lambda: "waiting for process" in out.read_text(), proc)
    held.close()
    assert [proc.wait(timeout=240) for proc in procs] == [0, 0]
    texts = [out.read_text() for out in outs]
    assert sum("supervised steps" in t for t in texts) == 1 and sum("(cached)" in t for t in texts) == 1
    assert all(f"entry {cache}\n" in t for t in texts), texts
    assert is_complete_warmup(cache) and sorted(os.listdir(tmp_path / "cache")) == sorted(
        [os.path.basename(cache), os.path.basename(cache) + ".lock"])       # no temporary directory left


def test_a_half_written_entry_or_temporary_directory_is_never_taken_as_the_cache(tmp_path, capsys):
    args, _ = parse_args(ts.Args, [*MICRO, "--cache-dir", str(tmp_path)])
    task = load_task(args)
    cache = warmup_cache_dir(args, task, builtin_tokenizer(task))
    os.makedirs(cache)
    Path(cache, "config.json").write_text("{}")                         # weights and tokenizer missing
    os.makedirs(tmp_path / ".tmp-half")                                  # a writer killed mid-way
    Path(tmp_path, ".tmp-half", "config.json").write_text("{}")
    assert prepare_start_model(args, task, torch.device("cpu")) == cache
    assert "supervised steps" in capsys.readouterr().out                 # warmed up afresh
    assert is_complete_warmup(cache)
    model, _ = load_policy(cache, args, torch.device("cpu"))
    assert model.config.n_embd == 32


def test_warm_up_batches_cut_an_over_long_prompt_from_the_left_to_the_budget():
    """Whatever split the warm-up is given, a batch is at most max_prompt_tokens + answer + end token wide:
    the prompt keeps its end (the question asked), as generation's left truncation does."""
    tok = build_char_tokenizer(["0123456789 What is it?\n#"])
    question, answer = "1" * 50_000 + " What is it?", "#### 1"
    ids, attn, labels = sft_batch(tok, [question, "What?"], [answer, answer], torch.device("cpu"),
                                  max_prompt_tokens=20)
    assert ids.shape == (2, 20 + len(answer) + 1)
    assert tok.decode(ids[0, :20]) == ("1" * 50_000 + " What is it?\n")[-20:]
    assert (labels[0, :20] == -100).all() and tok.decode(labels[0, 20:]) == answer + "<|endoftext|>"
    assert attn[1].sum() == len("What?\n") + len(answer) + 1               # the short row is not padded out


def test_warm_up_batches_cut_a_row_longer_than_the_models_positions_at_its_end():
    """A row of prompt + answer + end token longer than max_positions keeps its first max_positions tokens: the
    answer's beginning, labelled, and no end token (the model is not taught to stop where the cut falls)."""
    tok = build_char_tokenizer(["0123456789 What is it?\n#"])
    long_answer = "1+1=2. " * 10 + "#### 2"
    ids, attn, labels = sft_batch(tok, ["What is it?", "What?"], [long_answer, "#### 1"], torch.device("cpu"),
                                  max_prompt_tokens=20, max_positions=30)
    assert ids.shape == (2, 30) and attn[0].sum() == 30
    assert tok.decode(ids[0]) == ("What is it?\n" + long_answer)[:30]
    assert (labels[0, :12] == -100).all() and torch.equal(labels[0, 12:], ids[0, 12:])   # the answer, labelled
    assert tok.eos_token_id not in labels[0].tolist()
    assert attn[1].sum() == len("What?\n") + len("#### 1") + 1 and labels[1, attn[1].sum() - 1] == tok.eos_token_id


def test_answers_longer_than_the_built_in_models_positions_are_counted_and_cut_for_the_warm_up(tmp_path, capsys):
    """A user's JSONL with answers that do not fit the built-in model's positions after their question (MICRO:
    256 + 12 + 8 = 276): the warm-up, the only part that trains on an answer's text (rewards and evaluation read
    its number), cuts them to fit and says so in one warning line; the run goes through, with exit status 0.
    Before, the warm-up stopped on an index error in the position embedding."""
    rows = [{"question": f"What is {i} plus 1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(12)]
    for i, repeats in ((2, 60), (5, 90), (9, 120)):               # 7 characters per repeat: 420 to 840
        rows[i]["answer"] = "1+1=2. " * repeats + f"#### {i + 1}"
    path = tmp_path / "long_answers.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = [*MICRO, "--steps", "1", "--warmup-steps", "5", "--dataset", str(path), "--n-test", "4",
            "--cache-dir", str(tmp_path / "cache")]
    train = load_task(parse_args(ts.Args, argv)[0])["train"]
    needed = [len(format_prompt(q)) + len(a) + 1 for q, a in zip(train["question"], train["answer"])]  # characters
    over = sum(n > 276 for n in needed)
    assert over >= 2                                               # the seeded held-out fifth left them in training
    assert ts.main([*argv, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warnings = [line for line in re.split(r"[\r\n]+", err) if "warning" in line or "error" in line]
    assert warnings == [f"train_small.py: warning: warm-up: {over} of {len(train)} answers are longer than the "
                        f"built-in model's 276 positions allow after their question (the longest needs "
                        f"{max(needed)}); they are cut to fit (positions: --max-prompt-tokens + --max-new-tokens + 8)"]


def test_main_command_starts_from_the_committed_model_and_checks_its_files(tmp_path, monkeypatch, capsys):
    """The default settings (task seed 1) take tepokit/start_model/, whose tokenizer is the built-in task's;
    any other recipe (another task seed, another warm-up) does not; a changed byte is refused in one line."""
    args = ts.Args(cache_dir=str(tmp_path / "cache"))
    assert prepare_start_model(args, None, torch.device("cpu")) == START_MODEL_DIR
    assert "committed" in capsys.readouterr().out
    vocab = AutoTokenizer.from_pretrained(START_MODEL_DIR).get_vocab()
    assert vocab == builtin_tokenizer(load_task(args)).get_vocab()
    assert committed_start_model(dataclasses.replace(args, seed=2, task_seed=1)) == START_MODEL_DIR
    for other in (dict(seed=2), dict(task_seed=3), dict(warmup_steps=999), dict(sft_noise=0.4), dict(n_test=400)):
        assert committed_start_model(dataclasses.replace(args, **other)) is None, other
    assert not os.path.exists(tmp_path / "cache")                   # nothing was warmed up or cached
    damaged = tmp_path / "start_model"
    shutil.copytree(START_MODEL_DIR, damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(model_module, "START_MODEL_DIR", str(damaged))
    with pytest.raises(SystemExit) as exit_info:
        committed_start_model(args)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert "model.safetensors is damaged" in message and "\n" not in message


def test_a_micro_run_prints_no_warning_and_no_transformers_bar(tmp_path):
    """What a run prints is for the user: no warning they cannot act on (transformers' loss_type=None at the
    warm-up's first loss, TRL's FutureWarning) and no "Loading weights" / "Writing model shards" bars. Each
    engine's run starts in an empty directory, so the warm-up runs and saves its cache (where those showed).
    The two runs go at once: the suite waits for the slower."""
    runs = {}
    for engine in ("tepo", "trl"):
        os.makedirs(tmp_path / engine)
        runs[engine] = subprocess.Popen([sys.executable, SCRIPT, *MICRO, "--steps", "2", "--engine", engine,
                                         "--threads", "1", "--out", "run"], cwd=tmp_path / engine,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for engine, process in runs.items():
        stdout, stderr = process.communicate(timeout=600)
        printed = stdout + stderr
        assert process.returncode == 0, (engine, printed[-2000:])
        assert "held-out accuracy" in stdout, engine                  # the run did print its result
        lines = re.split(r"[\r\n]+", printed)                         # a bar redraws itself with carriage returns
        assert [line for line in lines if re.search(r"warn", line, re.IGNORECASE)] == [], engine
        assert [line for line in lines if re.search(r"Loading|Writing model shards|Fetching", line)] == [], engine


def test_the_built_in_tokenizer_and_the_fingerprint_of_a_task_are_made_once_per_content(monkeypatch):
    """The memory plan, the warm-up cache's key and the run's identity all need them; on a 50,000-row data set each
    takes seconds. A task whose rows change gets its own."""
    from tepokit.setup.task import task_fingerprint
    task = load_task(ts.Args(n_train=300, n_test=50, difficulty=6))
    made, real = [], model_module.build_char_tokenizer
    monkeypatch.setattr(model_module, "build_char_tokenizer", lambda *a: made.append(a) or real(*a))
    fingerprint = task_fingerprint(task)
    assert builtin_tokenizer(task) is builtin_tokenizer(task) and len(made) == 1
    assert task_fingerprint(task) == fingerprint
    task["train"] = task["train"].select(range(100))
    builtin_tokenizer(task)
    assert len(made) == 2 and task_fingerprint(task) != fingerprint


def broken_model_dir(path, broken: str) -> str:
    """A model directory of the micro model with one thing wrong: no tokenizer files, a tokenizer without an
    end token, the config of an architecture that is not a causal LM (T5), or a NaN weight."""
    tokenizer = build_char_tokenizer(["What is 1 plus 2?\n#### 3"])
    if broken == "not a causal LM":
        from transformers import T5Config
        T5Config(d_model=32, num_layers=1, num_heads=2, d_ff=64, vocab_size=len(tokenizer)).save_pretrained(path)
        tokenizer.save_pretrained(path)
        return str(path)
    build_tiny_model(ts.Args(n_layer=1, n_embd=32, n_head=2), tokenizer).save_pretrained(path)
    if broken == "NaN weights":
        from safetensors.torch import load_file, save_file
        weights = load_file(os.path.join(path, "model.safetensors"))
        next(iter(weights.values()))[0] = float("nan")
        save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(path)
    if broken == "a tokenizer without an end token":
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        words = Tokenizer(models.WordLevel({"[UNK]": 0, "What": 1, "is": 2}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("broken, needle", [
    ("no tokenizer files", "has no tokenizer files (tokenizer.json, tokenizer_config.json, vocab.json, ...)"),
    ("a tokenizer without an end token", "has no end token (eos_token)"),
    ("not a causal LM", "holds a t5 model (), not a causal language model"),
    ("NaN weights", "holds NaN or infinite weights, in 1 of its tensors (")])
def test_a_broken_model_directory_is_refused_in_one_line_before_the_run_directory_is_made(tmp_path, broken, needle):
    """Each problem found before the run directory is claimed: one line, exit status 2, no --out created, so
    the same command runs once the directory is fixed (no "holds a run" refusal, no run to --resume)."""
    model_dir = broken_model_dir(tmp_path / "model", broken)
    before = sorted(os.listdir(model_dir))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as refused:
        ts.main([*MICRO, "--steps", "1", "--model", model_dir, "--out", str(tmp_path / "run")])
    lines = err.getvalue().strip().splitlines()
    assert refused.value.code == 2 and lines[-1].startswith("train_small.py: error: argument --model: "), lines
    assert needle in lines[-1], lines
    assert sorted(os.listdir(tmp_path)) == ["model"] and sorted(os.listdir(model_dir)) == before


def test_the_fused_gelu_is_gpt2s_activation_in_one_kernel():
    """use_fused_gelu swaps gelu_new for torch's tanh gelu: the same logits and gradient in float64 (to 1e-12)."""
    tok = build_char_tokenizer(["Ann has 3 pens. How many?"])
    torch.manual_seed(0)
    plain = model_module.build_tiny_model(ts.Args(n_layer=2, n_embd=32, n_head=2), tok).double()
    fused = copy.deepcopy(plain)
    model_module.use_fused_gelu(fused)
    assert type(plain.transformer.h[0].mlp.act).__name__ == "NewGELUActivation"
    assert isinstance(fused.transformer.h[0].mlp.act, torch.nn.GELU)
    ids = tok(["Ann has 3 pens. How many?"], return_tensors="pt").input_ids
    out = [m(input_ids=ids).logits for m in (plain, fused)]
    assert (out[0] - out[1]).abs().max() < 1e-12
    grads = [torch.autograd.grad(o.square().sum(), m.transformer.h[0].mlp.c_fc.weight)[0]
             for o, m in zip(out, (plain, fused))]
    assert (grads[0] - grads[1]).abs().max() < 1e-10
