"""tepokit/tools/bench.py: --bench without TRL says how to install it; the cost of tepo's input checks."""
import dataclasses
import json
import os
import sys
import time

import pytest
import torch

import tepo
import train_small as ts
from tepokit.core.clock import PhaseClock
from tepokit.tools import bench
from tepokit.cli import flags as cli
from tepokit.cli.flags import parse_args
from tepokit.tests.helpers import MICRO


def test_bench_without_trl_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "trl", None)            # import trl raises ImportError
    with pytest.raises(SystemExit) as e:
        ts.main(["--bench"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "pip install" in err[0] and os.listdir(tmp_path) == []


@pytest.mark.parametrize("objective", sorted(tepo.OBJECTIVES))
def test_input_check_cost_times_the_checks_and_the_objective_on_the_bench_mini_batch(objective):
    """The line --bench prints: both times measured (no claim about their ratio: timings vary) on a
    mini-batch of the run's shape, rows_per_minibatch x max_new_tokens."""
    args, overrides = parse_args(ts.Args, [*MICRO, "--objective", objective])
    cost = bench.input_check_cost(args, overrides, repeats=3)
    assert cost["batch"] == "[4, 12]"                  # ceil(2 prompts / 2 mini-batches) x 4 samples, 12 tokens
    assert cost["checks_s"] > 0 and cost["objective_s"] > 0


def test_the_attention_formulas_equal_the_counted_matrix_products_of_attention_written_out():
    """FlopCounterMode does not know the CPU's attention kernel; bench's formulas for it must equal what
    it counts for the same attention written as matrix products, forward and backward."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: bench.attention_flops,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: bench.attention_backward_flops}
    q, k, v = (torch.randn(2, 3, n, 8, requires_grad=True) for n in (5, 7, 7))
    counted = {}
    for name, attend in (("kernel", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)),
                         ("written out", lambda: torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v)):
        with FlopCounterMode(display=False, custom_mapping=mapping) as forward:
            out = attend()
        with FlopCounterMode(display=False, custom_mapping=mapping) as backward:
            out.sum().backward()
        counted[name] = forward.get_total_flops(), backward.get_total_flops()
    assert counted["kernel"] == counted["written out"] == (4 * 2 * 3 * 5 * 7 * 8, 8 * 2 * 3 * 5 * 7 * 8)


def test_the_phase_clock_gives_each_phase_its_seconds_and_its_flops():
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    a = torch.randn(64, 32)
    with FlopCounterMode(display=False) as counter:
        clock = PhaseClock(flop_counter=counter)
        a @ a.T
        clock.lap("product")
        clock.lap("nothing")
        row = clock.row()
    assert row["flops/product"] == 2 * 64 * 32 * 64 and row["flops/nothing"] == 0
    assert row["step_time"] == pytest.approx(row["timing/product"] + row["timing/nothing"])
    assert "flops/product" not in PhaseClock().row()          # not counting: seconds only
    assert bench.matmul_rate(1, torch.float32, n=128, repeats=3) > 1e6


def test_the_memory_runs_get_the_benchs_settings_on_their_command_line():
    args, overrides = parse_args(ts.Args, [*MICRO, "--objective", "dapo", "--no-dynamic-sampling", "--eps-high",
                                           "0.3", "--precision", "bf16", "--no-check-sampling-logprobs"])
    argv = [a for k, v in {**{f: getattr(args, f) for f in ("n_layer", "precision", "check_sampling_logprobs",
                                                            "objective")}, **overrides}.items()
            for a in cli.flag_and_value(k, v)]
    again, again_overrides = parse_args(ts.Args, argv)
    assert (again.n_layer, again.precision, again.objective) == (1, "bf16", "dapo")
    assert again.check_sampling_logprobs is False
    assert again_overrides == overrides == {"dynamic_sampling": False, "eps_high": 0.3}


def test_rollout_memory_runs_the_rollout_and_twice_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args, overrides = parse_args(ts.Args, [*MICRO, "--objective", "grpo"])
    result = bench.rollout_memory(args, overrides, str(tmp_path / "bench"))
    assert result["micro_batch_size"] == 4 and set(result["peak_mb_above_start"]) == {2, 4}
    assert all(mb > 0 for mb in result["peak_mb_above_start"].values())
    for prompts in (2, 4):
        config = json.load(open(tmp_path / "bench" / f"memory_{prompts}_prompts" / "config.json"))
        assert config["args"]["prompts_per_step"] == prompts and config["args"]["micro_batch_size"] == 4
        assert config["args"]["n_layer"] == 1 and config["args"]["steps"] == 1


@pytest.mark.parametrize("flags, beta", [([], 0.0), (["--objective", "grpo"], 0.04),
                                         (["--objective", "grpo", "--beta", "0"], 0.0)])
def test_trl_gets_our_settings_in_its_own_names(flags, beta, tmp_path):
    """--bench's GRPOConfig: the rollout our step trains, split as ours is (mini-batches, micro-batches,
    epochs), a reference model exactly when ours has one, our precision and checkpointing; made without a
    FutureWarning (no deprecated argument names)."""
    import warnings
    from trl import GRPOConfig
    args, overrides = parse_args(ts.Args, ["--bench", "--prompts-per-step", "8", "--group-size", "4",
                                           "--mini-batches", "2", "--micro-batch-size", "8", "--epochs", "3",
                                           "--max-new-tokens", "20", "--gradient-checkpointing", "--bench-steps",
                                           "2", "--temperature", "0.9", "--lr", "2e-5", *flags])
    cfg = bench.objective_config(args, {**overrides, "dynamic_sampling": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = GRPOConfig(**bench.bench_trl_config(args, cfg, str(tmp_path)))
    assert config.beta == beta and (beta > 0) == tepo.needs_ref(args.objective, cfg)
    assert config.per_device_train_batch_size == 8 and config.gradient_accumulation_steps == 2   # 16-row mini-batch
    assert config.generation_batch_size == 32 and config.num_generations == 4                   # the whole rollout
    assert config.steps_per_generation // config.gradient_accumulation_steps == 2                # two mini-batches
    assert config.num_iterations == 3 and config.max_steps == (2 + 1) * 2 * 3                   # 3 rollouts
    assert config.max_completion_length == 20 and config.temperature == 0.9 and config.learning_rate == 2e-5
    assert config.top_k == 0 and config.top_p == 1.0
    assert config.gradient_checkpointing and not config.bf16 and config.report_to == []
    args16, _ = parse_args(ts.Args, ["--bench", "--precision", "bf16"])
    assert GRPOConfig(**bench.bench_trl_config(args16, cfg, str(tmp_path))).bf16


def test_the_bench_times_every_row_and_says_the_median_and_range_of_its_repeats():
    summary = bench.ratio_summary([2.0, 3.0, 2.4], [1.0, 1.0, 1.2])
    assert summary == {"per_repeat": [2.0, 3.0, 2.0], "median": 2.0, "min": 2.0, "max": 3.0}
    assert bench.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    args, _ = parse_args(ts.Args, ["--bench"])
    run = bench.bench_args(args, "out")
    assert run.steps == args.bench_steps + 1 and run.entropy_check_every > run.steps and not run.bench


@pytest.mark.parametrize("flags, first", [([], False), (["--decode-precision", "tf32"], False),
                                          (["--precision", "bf16"], False), (["--recompute-old-logprobs"], True),
                                          (["--no-recompute-old-logprobs"], False)])
def test_the_first_side_takes_the_samplers_old_logprobs_unless_told_and_the_second_recomputes(flags, first):
    """Unset, TF32 and bf16 runs recompute the old log-probs (tepokit/core/step_settings.py): the bench's first side
    asks for the sampler's, so that its two sides differ by exactly that; a choice given on the command line stays."""
    args, _ = parse_args(ts.Args, ["--bench", *flags])
    sampler, recomputing = bench.old_logprob_sides(args)
    assert sampler.recompute_old_logprobs is first and recomputing.recompute_old_logprobs is True
    assert dataclasses.replace(sampler, recompute_old_logprobs=None) == dataclasses.replace(args,
                                                                                            recompute_old_logprobs=None)


def test_the_gpt2_small_shape_is_a_preset_that_flags_override_and_is_refused_with_a_model():
    args, _ = parse_args(ts.Args, ["--bench", "--bench-shape", "gpt2-small", "--bench-steps", "2"])
    assert (args.prompts_per_step, args.group_size, args.max_new_tokens, args.bench_steps) == (2, 8, 128, 2)
    with pytest.raises(SystemExit) as e:
        parse_args(ts.Args, ["--bench", "--bench-shape", "gpt2-small", "--model", "some/model"])
    assert e.value.code == 2


def test_on_a_gpu_each_lap_and_each_timed_product_waits_for_the_kernels(monkeypatch):
    """CUDA's kernels run asynchronously: the clock and the matmul rate wait for them (torch.cuda.synchronize)
    before each reading of the time, whenever this process has started CUDA; on the CPU they never call it."""
    import torch
    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(1))
    clock = PhaseClock()
    clock.lap("generate")
    bench.matmul_rate(1, torch.float32, n=64, repeats=3)
    assert waits == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    clock = PhaseClock()
    clock.lap("generate")
    clock.lap("update")
    assert len(waits) == 3
    bench.matmul_rate(1, torch.float32, n=64, repeats=3)
    assert len(waits) == 3 + 2 * 3


def test_where_the_step_goes_names_the_device_and_its_rate_in_the_runs_dtype(capsys):
    """Each phase's FLOP/s against the matmul rate of the device that ran it: 0.5 TFLOP in a 1-second update
    at a rate of 1 TFLOP/s is 50% of the rate."""
    import torch
    seconds = {"timing/generate": 2.0, "timing/reward": 0.5, "timing/old_logprobs": 0.5, "timing/update": 1.0,
               "step_time": 4.0}
    flops = {"generate": 1e11, "reward": 0, "old_logprobs": 2e11, "update": 5e11}
    bench.print_phases(seconds, flops, 1e12, "NVIDIA H200, bfloat16")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "where the step goes (dense matmul rate of NVIDIA H200, bfloat16: 1000.0 GFLOP/s):"
    update = next(line.split() for line in lines if line.strip().startswith("update"))
    assert update == ["update", "1.000", "25%", "500.00", "500.00", "50.0%"]
    assert bench.device_name(torch.device("cpu")).startswith("CPU ")


def test_the_result_splits_each_sides_step_into_its_generation_and_the_rest(capsys):
    """print_result: the medians of each side's step and of its generation, and their ratios (TRL's over ours)."""
    result = {"ours": [{"step_time": 4.0, "timing/generate": 2.0}, {"step_time": 5.0, "timing/generate": 3.0},
                       {"step_time": 3.0, "timing/generate": 1.0}],
              "ours_recomputed": [{"step_time": 4.5}] * 3,
              "trl": [{"step_time": 10.0, "timing/generate": 7.0}] * 3,
              "ratio": bench.ratio_summary([10.0] * 3, [4.0, 5.0, 3.0]),
              "ratio_recomputed": bench.ratio_summary([10.0] * 3, [4.5] * 3)}
    bench.print_result(result, "tf32")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "our step is 2.50x the speed of TRL's (median of 3 repeats; range 2.00x to 3.33x)"
    assert lines[1] == ("generation: ours 2.000 s, TRL's 7.000 s (3.50x); the rest of the step: ours 2.000 s, "
                        "TRL's 3.000 s (1.50x)")
    assert lines[2].startswith("recomputing the old log-probs (--recompute-old-logprobs, the default in bf16 and "
                               "TF32) costs 0.500 s a step (+12%): 2.22x TRL's")


def test_trls_generation_decodes_in_our_runs_decoding_precision(tmp_path, monkeypatch):
    """The same work on both sides: with --decode-precision bf16, TRL's GRPOTrainer generates over bf16 weights
    (ours does, tepokit/core/sampling.py's decoding) and trains over its fp32 ones again afterwards. Its generation
    is timed: made 0.25 s slower, the timed rollout's generation takes at least that, and less than its step."""
    from trl import GRPOTrainer
    seen, trained, generate, compute_loss = [], [], GRPOTrainer._generate_single_turn, GRPOTrainer.compute_loss

    def recording(self, *args, **kwargs):
        seen.append({p.dtype for p in self.model.parameters()})
        time.sleep(0.25)
        return generate(self, *args, **kwargs)

    def training(self, *args, **kwargs):
        trained.append({p.dtype for p in self.model.parameters()})
        return compute_loss(self, *args, **kwargs)
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", recording)
    monkeypatch.setattr(GRPOTrainer, "compute_loss", training)
    args, overrides = parse_args(ts.Args, [*MICRO, "--bench", "--bench-steps", "1", "--decode-precision", "bf16"])
    cfg = bench.objective_config(args, {**overrides, "dynamic_sampling": False})
    timed = bench.bench_trl(args, cfg, str(tmp_path / "trl"), "bf16")
    assert seen and all(dtypes == {torch.bfloat16} for dtypes in seen) and timed["step_time"] > 0
    assert trained and all(dtypes == {torch.float32} for dtypes in trained)
    assert 0.25 <= timed["timing/generate"] < timed["step_time"]
