"""python -m tepokit.tools.gpu_check: the GPU measurements as one command. On the CPU with --micro (2-layer models
of width 64, the real vocabularies): generation's table for both samplers in the three decoding precisions, with
the log-prob gaps the sampler really has; the memory runs are valid train_small.py commands; bad input is refused in
one line with nothing written."""
import json
import subprocess
import sys

import pytest
import torch

import train_small as ts
from tepokit.cli.flags import parse_args
from tepokit.tools import gpu_check


def test_generation_is_measured_for_both_samplers_in_each_precision_with_its_gap(tmp_path, capsys):
    out = tmp_path / "check"
    out.mkdir()                                                         # an empty --out is taken as a new one
    result = gpu_check.main(["--micro", "--parts", "generation", "--out", str(out)])
    rows = {(r["shape"], r["decode"]): r for r in result["generation"]}
    assert set(rows) == {(s, d) for s in gpu_check.GENERATION_SHAPES for d in gpu_check.DECODES}
    for shape in gpu_check.GENERATION_SHAPES:
        assert rows[shape, "fp32"]["rows"] == 8 and rows[shape, "fp32"]["new_tokens"] == 8   # no end token: all 8
        assert rows[shape, "fp32"]["token_max"] < 1e-5                  # fp32 decoding: the trainer's log-probs
        assert 1e-4 < rows[shape, "bf16"]["token_max"] < 0.05           # bf16: off by bf16 rounding
        assert rows[shape, "bf16"]["sequence_mean_max"] <= rows[shape, "bf16"]["token_max"]
        assert all(rows[shape, d]["ms_per_token"] > 0 and "decode_step_ms" in rows[shape, d] for d in gpu_check.DECODES)
    assert json.loads((out / "gpu_check.json").read_text())["generation"] == result["generation"]
    table = (out / "gpu_check.md").read_text()
    assert "| qwen2.5-0.5b | static KV cache | bf16 |" in table and "not a measurement" in table
    assert table in capsys.readouterr().out


def test_the_profile_says_where_each_generation_call_spends_its_time(tmp_path, capsys):
    """The profile part on the CPU: a row per shape and decoding precision, torch's operators' time per new token
    beside the call's wall time, the largest first, no CUDA graph replayed (a CPU has none), each profiler's whole
    table kept, and the tables in gpu_check.md."""
    out = tmp_path / "check"
    result = gpu_check.main(["--micro", "--parts", "profile", "--out", str(out)])
    rows = {(r["shape"], r["decode"]): r for r in result["profile"]}
    assert set(rows) == {(s, d) for s in gpu_check.GENERATION_SHAPES for d in gpu_check.DECODES}
    for (shape, decode), r in rows.items():
        assert r["new_tokens"] == 8 and r["unit"] == "operator" and r["graph_replays"] == 0
        assert 0 < r["top"][0]["ms_per_token"] <= r["busy_ms_per_token"] and r["wall_ms_per_token"] > 0
        times = [k["ms_per_token"] for k in r["top"]]
        assert times == sorted(times, reverse=True) and len(times) == 8
        assert all(k["name"].startswith("aten::") for k in r["top"])
        assert "aten::" in (out / "profile" / f"{shape}_{decode}.txt").read_text()
    # every sampling step draws once from the whole vocabulary: one multinomial per new token
    assert all(any(k["name"] == "aten::exponential_" and k["calls_per_token"] == 1 for k in r["top"])
               for r in rows.values() if r["decode"] == "fp32")
    table = (out / "gpu_check.md").read_text()
    assert "## Where generation's time goes" in table and "| qwen2.5-0.5b | bf16 |" in table
    assert table in capsys.readouterr().out


def test_where_the_time_goes_counts_calls_and_time_per_new_token():
    """where_the_time_goes over a profile of known work: 6 matrix products and 3 exponentials read as 3 new tokens
    give 2 and 1 calls per token, and the operators' own times (microseconds) added up, in ms per token."""
    from torch.profiler import ProfilerActivity, profile
    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            torch.mm(a, a), torch.mm(a, a), torch.exp(a)
    events = profiler.key_averages()
    seen = gpu_check.where_the_time_goes(events, on_gpu=False, new_tokens=3, top=2)
    calls = {k["name"]: k["calls_per_token"] for k in seen["top"]}
    assert calls == {"aten::mm": 2.0, "aten::exp": 1.0}
    own = {e.key: e.self_cpu_time_total for e in events}
    assert seen["top"][0]["ms_per_token"] == pytest.approx(own[seen["top"][0]["name"]] / 3 / 1e3)
    assert seen["busy_ms_per_token"] == pytest.approx(sum(own.values()) / 3 / 1e3)
    count = {e.key: e.count for e in events}                           # with the mm's own resolve_conj calls
    assert seen["launches_per_token"] == sum(count.values()) / 3 and seen["graph_replays"] == 0


def test_a_kernels_name_is_shortened_to_what_tells_it_apart():
    name = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
            "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")
    assert gpu_check.short(name).startswith("vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, array<")
    assert len(gpu_check.short(name)) == 90 and gpu_check.short("a|b`c") == "a/b'c"


def test_the_bench_table_gives_each_decodings_ratio_and_where_each_side_spends_its_step():
    """The bench part's row as report() writes it: each side's seconds per step, the ratios, and each side's median
    step split into its generation and the rest; a failed bench a row of its own."""
    row = {"run": "tf32", "returncode": 0, "ratio": {"median": 2.5, "min": 2.0, "max": 3.33},
           "ratio_recomputed": {"median": 2.22}, "ours_seconds": [4.0, 5.0, 3.0], "trl_seconds": [10.0, 10.0, 10.0],
           "generate_seconds": {"ours": [2.0, 3.0, 1.0], "trl": [7.0, 6.0, 8.0]}}
    table = gpu_check.report({"device": "NVIDIA H100 80GB HBM3", "torch": "2.11", "started_at": "a", "finished_at": "b",
                              "micro": False, "code": {"commit": "c", "uncommitted_changes": False},
                              "bench": [row, {"run": "bf16", "returncode": 1}]})
    lines = table.splitlines()
    assert ("| tf32 | 4.000, 5.000, 3.000 | 10.000, 10.000, 10.000 | 2.50x (2.00-3.33) | 2.22x | 2.000, 7.000 s | "
            "2.000, 3.000 s |") in lines
    failed = next(line for line in lines if line.startswith("| bf16 |"))
    assert failed.count("|") == lines[lines.index(failed) - 2].count("|") and "failed (exit 1)" in failed


@pytest.mark.parametrize("number", range(1, len(gpu_check.MEMORY_RUNS) + 1))
def test_each_memory_run_is_a_valid_train_small_command(number, tmp_path):
    """What measure_memory runs, as train_small.py parses and validates it (a refused run would exit 2)."""
    name, shape, flags = gpu_check.MEMORY_RUNS[number - 1]
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "a?", "answer": "#### 1"}) + "\n")
    args, _ = parse_args(ts.Args, ["--dataset", str(tmp_path / "data.jsonl"), *gpu_check.COMMON_FLAGS,
                                   "--max-new-tokens", "256", "--max-prompt-tokens", "256", *flags])
    assert args.check_memory_on_device and args.objective == "grpo" and args.prompts_per_step * args.group_size == 128


@pytest.mark.parametrize("run", list(gpu_check.BENCH_RUNS))
def test_each_bench_run_is_a_valid_train_small_command(run, capsys):
    """What measure_bench runs, as train_small.py parses and validates it, without a warning: the bench at GPT-2
    small's shape and the table's work in the run's precision, the sampler's old log-probs on its first side."""
    from tepokit.tools.bench import old_logprob_sides
    args, _ = parse_args(ts.Args, [*gpu_check.BENCH_FLAGS, "--max-new-tokens", "256", *gpu_check.BENCH_RUNS[run]])
    assert capsys.readouterr().err == ""
    assert args.bench and args.bench_shape == "gpt2-small" and args.prompts_per_step * args.group_size == 128
    assert [side.recompute_old_logprobs for side in old_logprob_sides(args)] == [False, True]
    assert (args.precision, args.decode_precision) == (("bf16", "auto") if run == "bf16-autocast" else ("fp32", run))


@pytest.mark.parametrize("argv, says", [(["--parts", "generation,speed"], "--parts"),
                                        (["--bench-runs", "fp16"], "--bench-runs"),
                                        (["--memory-runs", "9"], "--memory-runs"), (["--jobs", "0"], "--jobs")])
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(argv, says, tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-m", "tepokit.tools.gpu_check", *argv, "--out", str(out)],
                          capture_output=True, text=True, cwd=gpu_check.os.path.dirname(gpu_check.SCRIPT))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr
    assert lines[0].startswith("python -m tepokit.tools.gpu_check: error: ") and not out.exists()


def test_a_check_cut_short_keeps_every_row_it_measured(tmp_path, monkeypatch):
    """Each row is written to gpu_check.json as soon as it is measured: stopped during the second row's calls, the
    file holds the first row, whole."""
    from tepokit.core import sampling
    calls, sample = [], sampling.sample

    def stopped_at_the_sixth_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:                 # the first row takes 4 calls: untimed, two timed, one half as long
            raise KeyboardInterrupt
        return sample(*args, **kwargs)
    monkeypatch.setattr(sampling, "sample", stopped_at_the_sixth_call)
    out = tmp_path / "check"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--micro", "--parts", "generation", "--out", str(out)])
    kept = json.loads((out / "gpu_check.json").read_text())
    assert [(r["shape"], r["decode"]) for r in kept["generation"]] == [("gpt2-small", "fp32")]
    assert kept["generation"][0]["ms_per_token"] > 0 and "finished_at" not in kept
