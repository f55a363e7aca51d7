"""The models: the built-in character tokenizer and tiny GPT-2 / Qwen2, its supervised warm-up (cached
as an ordinary Hugging Face model directory), and loading any causal LM for RL (end tokens, plain
sampling, dropout off)."""

from __future__ import annotations

import hashlib
import json
import math
import os

import torch
from tqdm.auto import tqdm

from tepokit.plumbing.non_finite import Diverged, non_finite_weights
from tepokit.core.forward import as_list
from tepokit.plumbing.errors import fail, first_line, warn
from tepokit.plumbing.hub import cannot_load, use_offline_hub_if_unreachable, without_transformers_bars
from tepokit.plumbing.rundir import fingerprint, lock_file, save_pretrained_atomically
from tepokit.setup.task import task_fingerprint, task_key, task_seed
from tepokit.core.reward import check_chat_template, end_of_turn_id, format_prompt, uses_chat_template

END = "<|endoftext|>"   # end of sequence AND padding, as in GPT-2: the end token must still be trained


def build_char_tokenizer(texts, vocab_size: int | None = None):
    """A character-level tokenizer made locally with `tokenizers`, wrapped for transformers. vocab_size:
    pad the vocabulary to this size with tokens no text encodes to (a real model's vocabulary size)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = sorted(set("".join(texts)) | set("0123456789+-*/=#.,:?! \n"))
    vocab = {END: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), vocab_size or 0)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()                                                      # join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END, pad_token=END, unk_token="<unk>",
                                   padding_side="left", clean_up_tokenization_spaces=False)


def builtin_positions(args) -> int:
    """The built-in model's positions: the longest prompt and the longest completion, and 8 to spare."""
    return args.max_prompt_tokens + args.max_new_tokens + 8


def tiny_model_config(args, tokenizer):
    """The built-in model's transformers config: GPT-2 or Qwen2 of the --n-layer/--n-embd/--n-head size."""
    from transformers import GPT2Config, Qwen2Config
    eos = tokenizer.eos_token_id
    common = dict(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if args.arch == "gpt2":
        return GPT2Config(n_positions=builtin_positions(args), n_embd=args.n_embd,
                          n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, **common)
    return Qwen2Config(hidden_size=args.n_embd, intermediate_size=4 * args.n_embd,
                       num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                       num_key_value_heads=args.n_head, tie_word_embeddings=True,
                       max_position_embeddings=builtin_positions(args), **common)


def build_tiny_model(args, tokenizer):
    """A small causal LM from a transformers config, dropout off (ratios must be 1 on-policy)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(tiny_model_config(args, tokenizer))
    # transformers infers the loss from the class name, and GPT2LMHeadModel's does not say "ForCausalLM": without
    # this the warm-up's first loss warns that loss_type=None is unrecognized (and then uses this loss anyway).
    model.loss_type = "ForCausalLM"
    return model


BUILTIN_TOKENIZERS: dict[tuple, object] = {}     # (task_key, vocab_size) -> tokenizer: the memory plan's is reused


def builtin_tokenizer(task, vocab_size: int | None = None):
    """The built-in task's character tokenizer (the characters of its texts), padded to vocab_size if given.
    Made once per task: reading every text of a large data set takes seconds."""
    key = (task_key(task), vocab_size)
    if key not in BUILTIN_TOKENIZERS:
        BUILTIN_TOKENIZERS[key] = build_char_tokenizer(list(task["train"]["question"]) + list(task["train"]["answer"])
                                                       + list(task["test"]["question"]), vocab_size)
    return BUILTIN_TOKENIZERS[key]


# What determines the warmed-up built-in model, besides the code: these settings and the task seed.
WARMUP_SETTINGS = ("arch", "n_layer", "n_embd", "n_head", "task", "difficulty", "ops", "sft_noise", "majority",
                   "n_train", "n_test", "warmup_steps", "warmup_lr", "warmup_batch", "max_prompt_tokens",
                   "max_new_tokens")


def warmup_recipe(args) -> dict:
    """The settings that determine the warm-up, with the task's seed (task_seed) under "seed"."""
    return {**{k: getattr(args, k) for k in WARMUP_SETTINGS}, "seed": task_seed(args)}


def warmup_cache_dir(args, task, tokenizer) -> str:
    """<--cache-dir>/warmup-<hash of everything that determines the warmed-up weights>: the settings, the
    data's identity (task_fingerprint: a run on the user's JSONL never meets the built-in task's entry)
    and the tokenizer's vocabulary (the embedding rows mean its tokens)."""
    recipe = warmup_recipe(args)
    for name, default in (("ops", "+-*"), ("task", "arith"), ("majority", 0.7)):
        if recipe[name] == default:  # a default is left out of the key: the default task's entries keep their names
            del recipe[name]
    vocabulary = fingerprint(sorted(tokenizer.get_vocab().items()))        # as run_identity hashes it
    blob = json.dumps(recipe | {"data": task_fingerprint(task), "tokenizer": vocabulary, "version": 2},
                      sort_keys=True)
    return os.path.join(args.cache_dir, "warmup-" + hashlib.sha1(blob.encode()).hexdigest()[:12])


# A cache entry is complete when it holds these: save_pretrained_atomically makes it appear whole, but a
# directory copied or written by other means may not be.
WARMUP_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def is_complete_warmup(cache: str) -> bool:
    return all(os.path.isfile(os.path.join(cache, name)) for name in WARMUP_FILES)


# The main command's start model is committed (tepokit/start_model/): the warm-up below, run once with the
# default settings and task seed 1. A warm-up run on another CPU rounds its sums differently and ends at another
# model, whose held-out accuracy is anywhere from about 0.18 to 0.32; from these files every machine starts at
# the same point. Their SHA-256 sums (SHA256SUMS) are checked before they are used.
# The hidden-type task's (--task hidden-type) is committed likewise, for its preset's settings and task seed 1.
TEPOKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))       # the committed start models' folder
START_MODEL_DIR = os.path.join(TEPOKIT_DIR, "start_model")
HIDDEN_TYPE_START_MODEL_DIR = os.path.join(TEPOKIT_DIR, "start_model_hidden_type")


def committed_start_model(args) -> str | None:
    """The committed start model of the run's built-in task when the run asks for exactly the warm-up it
    holds (built-in model, the recipe in its recipe.json); None otherwise. A damaged file is refused in one line."""
    directory = START_MODEL_DIR if args.task == "arith" else HIDDEN_TYPE_START_MODEL_DIR
    recipe_path = os.path.join(directory, "recipe.json")
    if args.model is not None or args.dataset is not None or not os.path.isfile(recipe_path):
        return None
    with open(recipe_path) as f:
        if json.load(f) != warmup_recipe(args):
            return None
    with open(os.path.join(directory, "SHA256SUMS")) as f:
        expected = dict(line.split()[::-1] for line in f if line.strip())
    for name, digest in expected.items():
        path = os.path.join(directory, name)
        found = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else "missing"
        if found != digest:
            fail(f"the committed start model {path} is damaged (SHA-256 {found[:12]}, expected {digest[:12]}); "
                 f"restore it with: git checkout -- {os.path.relpath(directory)}")
    return directory


def warmup_sequences(tokenizer, questions, answers, max_prompt_tokens: int | None = None) -> list[tuple]:
    """What the warm-up trains on, uncut: (ids, labels) of prompt + answer + end token per row, the labels
    -100 on the prompt. A prompt longer than max_prompt_tokens is cut from the left, as generation cuts it:
    load_task has counted such questions, and this bound keeps a batch's width, and so its memory, within
    the budget whatever split it is given."""
    prompts = tokenizer([format_prompt(q) for q in questions]).input_ids          # one call for all rows
    completions = tokenizer(list(answers), add_special_tokens=False).input_ids
    rows = []
    for p, c in zip(prompts, completions):
        p = p[-max_prompt_tokens:] if max_prompt_tokens else p
        c = c + [tokenizer.eos_token_id]
        rows.append((p + c, [-100] * len(p) + c))
    return rows


def sft_batch(tokenizer, questions, answers, device, max_prompt_tokens: int | None = None,
              max_positions: int | None = None):
    """Prompt + answer + end token (warmup_sequences), right-padded; labels only on answer and end tokens.

    A row longer than max_positions (the model's positions; the warm-up counts such rows,
    warn_of_over_long_answers) keeps its first max_positions tokens: the answer's beginning, without an end
    token, so the model is not taught to stop where the cut falls. A cut, not a refusal: the answer's text
    serves the warm-up alone (rewards and evaluation read only its number).
    """
    rows = [(ids[:max_positions], labels[:max_positions])
            for ids, labels in warmup_sequences(tokenizer, questions, answers, max_prompt_tokens)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)], labels[i, :len(y)], attn[i, :len(x)] = torch.tensor(x), torch.tensor(y), 1
    return ids.to(device), attn.to(device), labels.to(device)


def warmup_texts(split) -> list[str]:
    """What the warm-up imitates: the built-in tasks' demonstrations (tepokit/setup/task.py), or the answers."""
    return list(split["demonstration"] if "demonstration" in split.column_names else split["answer"])


def warn_of_over_long_answers(tokenizer, train_split, args) -> None:
    """One warning line when some rows of prompt + answer + end token are longer than the built-in model's
    positions (builtin_positions): sft_batch cuts them to fit, the same rows on every run."""
    positions = builtin_positions(args)
    lengths = [len(ids) for ids, _ in warmup_sequences(tokenizer, list(train_split["question"]),
                                                        warmup_texts(train_split), args.max_prompt_tokens)]
    over = sum(n > positions for n in lengths)
    if over:
        warn(f"warm-up: {over} of {len(lengths)} answers are longer than the built-in model's {positions} positions "
             f"allow after their question (the longest needs {max(lengths)}); they are cut to fit "
             "(positions: --max-prompt-tokens + --max-new-tokens + 8)")


def supervised_warmup(model, tokenizer, train_split, args, device):
    """A short supervised phase so the policy starts with partial accuracy (RL needs some reward)."""
    warn_of_over_long_answers(tokenizer, train_split, args)
    gen = torch.Generator().manual_seed(task_seed(args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.9 * s / max(1, args.warmup_steps))
    model.train()
    bar = tqdm(range(args.warmup_steps), desc="warm-up", dynamic_ncols=True)
    for step in bar:
        idx = torch.randint(len(train_split), (args.warmup_batch,), generator=gen).tolist()
        rows = train_split.select(idx)
        ids, attn, labels = sft_batch(tokenizer, list(rows["question"]), warmup_texts(rows), device,
                                      args.max_prompt_tokens, builtin_positions(args))
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        if not math.isfinite(loss.item()):      # the weights are gone: nothing of them is cached
            raise warmup_diverged(f"warm-up step {step + 1}: its loss is {loss.item()}", args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bad = non_finite_weights(model)
    if bad:
        raise warmup_diverged(f"the warm-up's last step left {bad[0]} non-finite", args)
    model.eval()


def warmup_diverged(what: str, args) -> Diverged:
    return Diverged(f"{what}, at --warmup-lr {args.warmup_lr:g}; nothing was cached; start again with a lower "
                    "--warmup-lr")


def prepare_start_model(args, task, device) -> str:
    """The directory or id RL starts from: --model, the committed start model (committed_start_model), or
    the warmed-up built-in model (cached).

    The cache entry is written under an OS lock on <entry>.lock (as a run directory is, tepokit/plumbing/rundir.py):
    two runs sharing --cache-dir never warm the same entry at once; the second waits, then finds the
    entry. The entry is written to a temporary directory and renamed, so it is whole or absent.
    """
    if args.model is not None:
        return args.model
    committed = committed_start_model(args)
    if committed is not None:
        print(f"start model: {os.path.relpath(committed)} (committed; the same on every machine)")
        return committed
    tokenizer = builtin_tokenizer(task)
    cache = warmup_cache_dir(args, task, tokenizer)
    if is_complete_warmup(cache):
        print(f"warm-up model: {cache} (cached)")
        return cache
    os.makedirs(args.cache_dir, exist_ok=True)
    lock = lock_file(cache + ".lock", f"the warm-up cache {cache}", wait=True)
    try:
        if is_complete_warmup(cache):       # another run wrote it while we waited for the lock
            print(f"warm-up model: {cache} (cached)")
            return cache
        print(f"warm-up model: {args.warmup_steps} supervised steps, then cached in {cache}")
        torch.manual_seed(task_seed(args))
        model = build_tiny_model(args, tokenizer).to(device)
        if args.warmup_steps > 0:
            supervised_warmup(model, tokenizer, task["train"], args, device)
        save_pretrained_atomically(model.cpu(), tokenizer, cache)
    finally:
        lock.close()
    return cache


def use_fused_gelu(model) -> None:
    """GPT-2's activation, gelu_new, is gelu's tanh approximation written as six elementwise operations,
    each a pass over the MLP's activations forward and another backward; torch's gelu(approximate="tanh")
    is the same function in one kernel each way (equal to float32 rounding). Swapped in place."""
    from transformers.activations import NewGELUActivation
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(module, name, torch.nn.GELU(approximate="tanh"))


# The models this process has loaded: transformers' "Loading weights" bar is shown for a model's first load
# only, not again for its reference model (or the next run of --compare).
LOADED = set()


# The files a tokenizer is read from, one of which a model directory must hold: without any, transformers
# makes a tokenizer with no vocabulary (GPT-2's class, holding only its end token).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def check_model_dir(args) -> None:
    """A local --model directory, checked before anything is loaded or written: a config.json that parses, of
    a causal language model (what AutoModelForCausalLM can load), and tokenizer files. A Hugging Face id is
    checked once loaded (tokenizer_problem, in load_policy). The first problem found is one line."""
    path = os.path.expanduser(args.model)
    if not os.path.isdir(path):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        with without_transformers_bars():
            config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- a missing or damaged config.json, an unknown model type: one line
        fail(f"argument --model: {path} has no config.json a model can be built from ({type(e).__name__}: "
             f"{first_line(e)}); give a Hugging Face model directory (config.json, weights, tokenizer files)")
    custom = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not custom:
        fail(f"argument --model: {path} holds a {config.model_type} model ({', '.join(config.architectures or [])}),"
             " not a causal language model; give a causal LM, such as GPT-2, Qwen2 or Llama")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        fail(f"argument --model: {path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); save the "
             "model's tokenizer there too (tokenizer.save_pretrained)")


def tokenizer_problem(tokenizer) -> str | None:
    """What makes a tokenizer unusable for RL, or None: a vocabulary of special tokens only, or no end token
    (generation could never stop, and padding a batch of prompts needs one)."""
    if len(tokenizer.get_vocab()) <= len(tokenizer.all_special_tokens):
        return "has no vocabulary (only special tokens)"
    if tokenizer.eos_token is None:
        return "has no end token (eos_token); set one in its tokenizer_config.json"
    return None


def load_policy(path: str, args, device):
    """Model and tokenizer from an id or directory; one-line error if it cannot be had."""
    offline_reason = None if os.path.exists(path) else use_offline_hub_if_unreachable()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    try:
        with without_transformers_bars(when=args.model is None or path in LOADED):
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
            # fp32 weights (Adam's master copy); with --precision bf16 the forward passes run under autocast
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=args.trust_remote_code,
                                                         dtype=torch.float32)
        LOADED.add(path)
    except Exception as e:  # noqa: BLE001 -- any loading failure is a user-facing one-liner
        cannot_load("model", path, e, offline_reason,
                    "give a local model directory, or run without --model for the built-in tiny model")
    problem = tokenizer_problem(tokenizer)
    if problem:
        fail(f"argument --model: the tokenizer of {path} {problem}; give a model directory with a whole tokenizer")
    check_chat_template(tokenizer, args.chat_template, path)
    bad = non_finite_weights(model)    # a run from them could only diverge, and would checkpoint them at step 0
    if bad:
        fail(f"argument --model: {path} holds NaN or infinite weights, in {len(bad)} of its tensors ({bad[0]} the "
             "first); give a model whose weights are finite")
    tokenizer.padding_side, tokenizer.truncation_side = "left", "left"   # generation needs left padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # Stop on every end token the model knows: Qwen2.5-Instruct's own generation config stops on
    # <|im_end|> and <|endoftext|>, its tokenizer names only one of them.
    own_eos = model.generation_config.eos_token_id
    # With a chat template, the end of the assistant's turn too (core/reward.py end_of_turn_id).
    end_of_turn = end_of_turn_id(tokenizer) if uses_chat_template(tokenizer, args.chat_template) else None
    eos_ids = sorted({i for i in as_list(own_eos) + as_list(model.config.eos_token_id) + [tokenizer.eos_token_id,
                                                                                            end_of_turn]
                      if i is not None})
    # Sampling must be plain softmax(z / T): a model's own generation defaults (top_k, top_p,
    # repetition penalty) would change the distribution and the log-probs would no longer describe it.
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)
    switch_off_dropout(model)
    use_fused_gelu(model)
    model.to(device).eval()
    if args.gradient_checkpointing:
        # transformers 5.24 names it activation checkpointing (the old name warns that it is deprecated)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model, tokenizer


def switch_off_dropout(model) -> None:
    """Dropout off everywhere: on-policy ratios must be exactly 1, also in train() mode (which gradient
    checkpointing needs). nn.Dropout modules, and every float `*dropout*` / `*pdrop*` setting of the
    config and of the modules: Qwen2's attention reads `self.attention_dropout`, a float copied from
    the config, in train() mode."""
    for key, value in model.config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(model.config, key, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)


def pick_device(args) -> torch.device:
    return torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                        else "cpu")
