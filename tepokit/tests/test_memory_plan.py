"""tepokit/tools/memory.py's plan against the tensor bytes real runs hold, phase by phase, counted as CUDA counts them.

torch.cuda.max_memory_allocated counts the blocks of CUDA's caching allocator: each new tensor storage rounded
up to 512 bytes, given back when the storage is freed, a view costing nothing. LiveBytes counts the same on
the CPU, op by op, so the plan meets on the CPU what it meets on a GPU (resident memory would not: the
allocator of the C library keeps freed blocks). Eleven 2-step GRPO runs of micro models with real shapes'
proportions (Qwen2's grouped-query attention, vocabularies of 8,192 to 32,768 tokens), five of them made to
peak in five different phases, one generating over transformers' static KV cache (--cuda-graphs on) and one over
it in bf16 (--decode-precision bf16), three with LoRA
adapters (--lora-rank: a frozen base, in fp32, its prefill, and under bf16 autocast); the second
step's generation runs with the gradients and Adam's moments of the first. Then GPT-2's sampling loop alone at an
evaluation's shape, with and without its static KV cache: what it holds while it decodes.
"""
import contextlib
import io
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tepo
import train_small as ts
from tepokit.core import clock
from tepokit.core import shared_prefix
from tepokit.cli.flags import objective_config, parse_args
from tepokit.tools.memory import PHASES, memory_plan, model_config_for_plan
from tepokit.setup.model import END, build_char_tokenizer, use_fused_gelu


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive, each rounded up to 512 bytes (CUDA's caching allocator's block),
    and their peak since `peak` was last set. Every op's outputs are seen; a storage already counted (a view,
    an in-place op's result) is not counted again, and a storage is subtracted when it is freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = {}                    # id of a live storage -> a weak reference to it

    def track(self, tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.storages:
            return
        nbytes = -(-storage.nbytes() // 512) * 512

        def freed(_, key=key, nbytes=nbytes):
            self.live -= nbytes
            del self.storages[key]

        self.storages[key] = weakref.ref(storage, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


def test_live_bytes_counts_storages_as_cudas_allocator_does():
    counter = LiveBytes()
    with counter:
        a = torch.ones(1000)                                   # 4,000 bytes: one 4,096-byte block
        view = a.view(10, 100)
        a.mul_(2)                                              # in place: no new storage
        assert counter.live == 4096
        b = a * 2 + 1                                          # a temporary (a * 2), freed, then b
        assert counter.live == 2 * 4096 and counter.peak == 3 * 4096
        del a
        assert counter.live == 2 * 4096                        # the view keeps a's storage
        del view, b
        assert counter.live == 0 and counter.peak == 3 * 4096


# The clock's laps (tepokit/clock.PhaseClock) and the plan's phases; a step's rewards count with its generation.
LAPS = {"generate": "generation", "reward": "generation", "old_logprobs": "old log-probs", "update": "update",
        "measure": "entropy check"}     # the lap of the measurements after the update, of which the check peaks


def measured_phases(argv, monkeypatch) -> tuple[dict, int]:
    """Run train_small.py in this process under LiveBytes: the peak bytes of each phase (PHASES) and of the
    whole RL loop. The models' parameters count from their loading on, as on a GPU."""
    counter, peaks, loop = LiveBytes(), {}, {"peak": 0}

    def ended(phase):
        peaks[phase] = max(peaks.get(phase, 0), counter.peak)
        loop["peak"] = max(loop["peak"], counter.peak)
        counter.peak = counter.live

    clock_init, clock_lap, evaluate, load_policy = (clock.PhaseClock.__init__, clock.PhaseClock.lap, ts.evaluate,
                                                    ts.load_policy)

    def init(clock):
        loop["peak"] = max(loop["peak"], counter.peak) if peaks else 0   # from the first step on
        counter.peak = counter.live
        clock_init(clock)

    def lap(clock, name):
        clock_lap(clock, name)
        ended(LAPS[name])

    def evaluated(*args, **kwargs):
        counter.peak = counter.live
        row = evaluate(*args, **kwargs)
        ended("evaluation")
        return row

    def loaded(*args, **kwargs):
        model, tokenizer = load_policy(*args, **kwargs)
        for tensor in [*model.parameters(), *model.buffers()]:
            counter.track(tensor)
        return model, tokenizer

    monkeypatch.setattr(clock.PhaseClock, "__init__", init)
    monkeypatch.setattr(clock.PhaseClock, "lap", lap)
    monkeypatch.setattr(ts, "evaluate", evaluated)
    monkeypatch.setattr(ts, "load_policy", loaded)
    with counter, contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ts.main(argv)
    return peaks, max(loop["peak"], counter.peak)


def save_model(path, config) -> str:
    """A random-weight model of `config` with a character tokenizer padded to its vocabulary."""
    from transformers import AutoModelForCausalLM
    tokenizer = build_char_tokenizer(["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"], config.vocab_size)
    end = tokenizer.convert_tokens_to_ids(END)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = end
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = end
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The models (random weights: no completion ends before --max-new-tokens) and problems whose prompts
    reach --max-prompt-tokens."""
    from transformers import GPT2Config, Qwen2Config
    d = tmp_path_factory.mktemp("memory_plan")
    with open(d / "data.jsonl", "w") as f:
        for i in range(100):          # 20 of them held out (tepokit/setup/task.py), more than --n-test 16
            question = " ".join(f"On day {j} Ann finds {i + j} more pens in the shed." for j in range(6))
            f.write(json.dumps({"question": question + " How many pens now?", "answer": f"#### {i}"}) + "\n")

    def qwen(inner):
        return Qwen2Config(vocab_size=32768, hidden_size=64, intermediate_size=inner, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           max_position_embeddings=512)
    gpt2 = GPT2Config(vocab_size=8192, n_positions=512, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0)
    models = {"qwen": save_model(d / "qwen", qwen(512)), "qwen_wide_mlp": save_model(d / "qwen_wide", qwen(2048)),
              "gpt2": save_model(d / "gpt2", gpt2)}
    return d, models


# (model, flags, the phase that peaks): GRPO, 4 prompts x 4 samples, 2 mini-batches, 2 steps.
CONFIGS = {
    # fp32, micro-batches of 4 rows in mini-batches of 8: the logits of 24 new tokens, their gradient, activations
    "fp32 micro-batches": ("qwen_wide_mlp", ["--micro-batch-size", "4", "--max-prompt-tokens", "24",
                                             "--max-new-tokens", "24", "--no-check-sampling-logprobs"], "update"),
    # two-row micro-batches with checkpointing: the rollout's prefill, 16 prompts of 128 tokens through the MLP
    "checkpointing, prefill": ("qwen_wide_mlp", ["--micro-batch-size", "2", "--gradient-checkpointing",
                                                 "--max-prompt-tokens", "128", "--max-new-tokens", "4",
                                                 "--no-check-sampling-logprobs"], "generation"),
    # bf16: the reference model's and the policy's forwards (recomputed in bf16) peak; precision_noise_floor's bf16
    # and fp32 log-probs of one micro-batch run after the step, in the entropy check's phase
    "bf16": ("qwen", ["--micro-batch-size", "8", "--precision", "bf16", "--max-prompt-tokens", "24",
                      "--max-new-tokens", "12"], "old log-probs"),
    # GPT-2's sampling loop: evaluation keeps each of 16 prompts' keys and values, training each group's once
    "gpt2 loop, evaluation": ("gpt2", ["--micro-batch-size", "2", "--max-prompt-tokens", "192", "--max-new-tokens",
                                       "4", "--n-test", "16", "--beta", "0"], "evaluation"),
    # the loop's old log-probs are the sampler's: the update's taps keep the logits of all 8 checked rows before its
    # first optimizer step ([c, T, V], tepokit/core/taps.py) and hold them through the update (its no-grad forward,
    # then the backward beside them) to the entropy check, which peaks with them and the logits after
    "gpt2 loop, taps' logits": ("gpt2", ["--micro-batch-size", "16", "--mini-batches", "1", "--max-prompt-tokens",
                                         "32", "--max-new-tokens", "128", "--entropy-check-every", "1",
                                         "--entropy-check-rows", "8"], "entropy check"),
    # --cuda-graphs on: transformers' StaticCache holds prompt + new tokens from the prefill on
    "static KV cache": ("qwen_wide_mlp", ["--micro-batch-size", "2", "--gradient-checkpointing", "--cuda-graphs", "on",
                                          "--max-prompt-tokens", "128", "--max-new-tokens", "8",
                                          "--no-check-sampling-logprobs"], "generation"),
    # --decode-precision bf16: generation over bf16 copies of the weights, its static cache and activations in bf16
    "bf16 decoding": ("qwen_wide_mlp", ["--micro-batch-size", "2", "--gradient-checkpointing", "--cuda-graphs", "on",
                                        "--decode-precision", "bf16", "--max-prompt-tokens", "128",
                                        "--max-new-tokens", "8", "--no-check-sampling-logprobs"], "generation"),
    # LoRA (rank 8 on the 7 projections): the frozen fp32 base without gradients or Adam moments, the adapters with
    # both; no reference model (the policy with its adapters off); the update's activations as before
    "LoRA, fp32": ("qwen", ["--micro-batch-size", "4", "--max-prompt-tokens", "24", "--max-new-tokens", "12",
                            "--no-check-sampling-logprobs", "--lora-rank", "8"], "update"),
    # LoRA with checkpointing: the rollout's prefill, through peft's adapted layers (each adds its adapter's output and
    # a scaled copy beside the base layer's)
    "LoRA, prefill": ("qwen", ["--micro-batch-size", "2", "--gradient-checkpointing", "--max-prompt-tokens",
                                        "128", "--max-new-tokens", "4", "--no-check-sampling-logprobs", "--lora-rank",
                                        "8"], "generation"),
    # LoRA under bf16 autocast over a fp32 base: without gradients each frozen weight is cast at its use and let go;
    # in the update's forward its cast is kept for the backward
    "LoRA, bf16 autocast": ("qwen", ["--micro-batch-size", "8", "--precision", "bf16", "--max-prompt-tokens", "24",
                                     "--max-new-tokens", "12", "--lora-rank", "8"], "update"),
    # the entropy check on every step: the logits before and after at 192 positions, and its temporaries
    "entropy check every step": ("qwen", ["--micro-batch-size", "4", "--max-prompt-tokens", "24", "--max-new-tokens",
                                          "12", "--entropy-check-every", "1", "--entropy-check-rows", "16"],
                                 "entropy check"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_plan_holds_the_peak_of_each_phase_counted_as_cuda_counts_it(name, setup, monkeypatch):
    """The plan of each phase (the model's state plus the phase, and the 5% it keeps for what it does not list)
    lies within -5% and +25% of the bytes measured in it, it names the phase where the run peaks, and there it is
    not below the measured peak. (LoRA's prefill without the adapters' outputs in the plan: 0.954.)"""
    d, models = setup
    model, flags, phase = CONFIGS[name]
    argv = ["--model", models[model], "--dataset", str(d / "data.jsonl"), "--objective", "grpo", "--steps", "2",
            "--prompts-per-step", "4", "--group-size", "4", "--n-test", "4", "--pass-k", "1",
            "--pass-k-problems", "1", "--eval-every", "100", "--save-every", "100", "--overlong-cache", "4",
            "--entropy-check-every", "100", "--threads", "1", *flags, "--out", str(d / name.replace(" ", "_"))]
    args, overrides = parse_args(ts.Args, argv)
    plan = memory_plan(args, model_config_for_plan(args, None), tepo.needs_ref(args.objective,
                                                                               objective_config(args, overrides)))
    measured, loop_peak = measured_phases(argv, monkeypatch)
    assert set(measured) == set(PHASES)
    assert loop_peak == max(measured.values())          # nothing between the phases peaks higher
    planned = {p: (1 + 0.05) * (sum(plan["parts"].values()) + plan["totals"][p]) for p in PHASES}
    ratios = {p: round(planned[p] / measured[p], 3) for p in PHASES}
    assert max(measured, key=measured.get) == plan["phase"] == phase, ratios
    assert plan["peak"] == pytest.approx(planned[phase])
    assert all(0.95 <= ratio <= 1.25 for ratio in ratios.values()), ratios
    assert ratios[phase] >= 1.0, ratios                 # where the run peaks, an upper bound


@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_the_gpt2_loop_decodes_beside_the_prompts_keys_and_values_not_their_forward(cuda_graphs):
    """An evaluation's greedy generation by GPT-2's loop (16 prompts of 64 tokens, one row each, 192 new tokens), with
    and without the static KV cache of --cuda-graphs (run eagerly on the CPU): the bytes alive from its prefill to
    its last token, beyond the weights, lie within -5% and +25% of the plan's evaluation, whose largest moment is
    decoding (the prompts' keys and values, the completions', the sampling step). The prefill's last layer is let go
    before decoding: kept, it added U * P * (5d * 4 + P) bytes, 1.38 MB here (27% more)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=2048, n_positions=512, n_embd=64, n_layer=2, n_head=4)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    use_fused_gelu(model)                                                      # as load_policy does
    args, _ = parse_args(ts.Args, ["--prompts-per-step", "4", "--group-size", "4", "--n-test", "16", "--pass-k", "1",
                                   "--pass-k-problems", "1", "--max-prompt-tokens", "64", "--max-new-tokens", "192",
                                   "--cuda-graphs", cuda_graphs])
    plan = memory_plan(args, config, needs_ref=False)
    assert plan["phases"]["evaluation"][0] == "decoding"
    prompt_ids = torch.randint(1, 2048, (16, 64))
    prompt_mask = (torch.arange(64) >= torch.arange(16)[:, None]).long()       # left padding: 0 to 15 tokens
    counter = LiveBytes()
    for tensor in [*model.parameters(), *model.buffers()]:
        counter.track(tensor)
    weights = counter.live
    static = cuda_graphs == "on"
    with counter:                      # no end token: every row runs to 192 tokens
        out = shared_prefix.sample_gpt2(model, prompt_ids, prompt_mask, 1, 192, 1.0, [], 0, greedy=True, static=static,
                                   capture=static)
    assert out["completion_ids"].shape == (16, 192)
    ratio = (1 + 0.05) * plan["totals"]["evaluation"] / (counter.peak - weights)
    assert 0.95 <= ratio <= 1.25, ratio
