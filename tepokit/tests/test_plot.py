"""tepokit/tools/plot.py: `python -m tepokit.tools.plot RUN_DIR`, the standard figures of a run, and its one-line
refusals."""
import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tepokit.plumbing import errors
from tepokit.tools import plot
from tepokit.tools.plot import FIGURE_SIZES, FIGURES, TWO_PANELS, main
from tepokit.tests.helpers import MICRO, REPO, run_main


@pytest.fixture(scope="module")
def micro_tepo_run(workdir):
    """A real micro TEPO run (details.jsonl, entropy checks, clipping) and the summary block it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run_main([*MICRO, "--steps", "6", "--out", "runs/plotted"])
    return workdir / "runs" / "plotted", printed.getvalue()


def test_the_command_the_summary_names_writes_every_figure_as_a_readable_png(micro_tepo_run, capsys):
    """The end-of-run summary names `python -m tepokit.tools.plot <run dir>`; that command writes the five standard
    figures into <run dir>/figures/: PNG images of the drawn size (inches x 110 dpi), RGB, not blank, and the
    same bytes when drawn again from the same logs."""
    run_dir, summary = micro_tepo_run
    command = re.search(r"python -m tepokit\.tools\.plot (\S+)", summary)
    assert command and Path(command[1]) == Path("runs/plotted")
    assert main([command[1]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [Path(line.split(" (")[0]).name for line in lines] == list(FIGURES)       # each figure, in order
    sizes = {name: (round(110 * w), round(110 * h)) for name, (w, h) in
             ((name, FIGURE_SIZES.get(name, TWO_PANELS)) for name in FIGURES)}              # inches x 110 dpi
    first = {}
    for name in FIGURES:
        with Image.open(run_dir / "figures" / name) as image:
            assert image.format == "PNG" and image.mode == "RGB"
            assert image.size == sizes[name], (name, image.size)
            assert len(image.getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50, name    # drawn, not blank
        first[name] = (run_dir / "figures" / name).read_bytes()
    assert main([str(run_dir)]) == 0
    assert all((run_dir / "figures" / name).read_bytes() == data for name, data in first.items())


def test_a_run_without_details_gets_its_figures_and_a_note_for_the_kl_mask(micro_tepo_run, tmp_path, capsys):
    """Without details.jsonl (any objective but TEPO, or --engine trl) the KL-mask figure is skipped with a
    note that says why; the other figures are written."""
    run_dir = tmp_path / "grpo_like"
    run_dir.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        shutil.copy(micro_tepo_run[0] / name, run_dir / name)
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "kl_mask.png: skipped, no details.jsonl (TEPO runs of the built-in engine write it)" in out
    assert sorted(p.name for p in (run_dir / "figures").iterdir()) == sorted(set(FIGURES) - {"kl_mask.png"})


@pytest.mark.parametrize("case, needle", [
    ("missing", "is not a run directory of train_small.py (it has no metrics.jsonl)"),
    ("no_metrics", "is not a run directory of train_small.py (it has no metrics.jsonl)"),
    ("empty_metrics", "metrics.jsonl is empty: the run has not logged its first evaluation yet"),
    ("damaged_metrics", "metrics.jsonl, line 2: not a JSON row"),
    ("rows_without_steps", "metrics.jsonl, line 2: not the row of a step (an object with an integer step)"),
    ("damaged_config", "config.json is damaged (JSONDecodeError: "),
])
def test_bad_input_is_refused_in_one_line_with_exit_status_2_and_nothing_written(tmp_path, capsys, case, needle):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
        (run_dir / "config.json").write_text("{}")
    if case == "empty_metrics":
        (run_dir / "metrics.jsonl").write_text("")
    if case == "rows_without_steps":
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n[1, 2]\n')
    if case == "damaged_config":
        (run_dir / "config.json").write_text('{"args": ')
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    if case == "damaged_metrics":
        (run_dir / "metrics.jsonl").write_text(f'{json.dumps({"step": 0})}\n{{not json\n{json.dumps({"step": 1})}\n')
    before = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None
    with pytest.raises(SystemExit) as stop:
        main([str(run_dir)])
    lines = capsys.readouterr().err.splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("python -m tepokit.tools.plot: error: ")
    assert needle in lines[0]
    assert (sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None) == before      # nothing written
    assert errors.PROGRAM == "train_small.py"            # train_small.py's own error lines keep their name


def test_the_module_runs_from_the_command_line():
    done = subprocess.run([sys.executable, "-m", "tepokit.tools.plot", "no/such/run"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("python -m tepokit.tools.plot: error: no/such/run is not a run directory of train_small.py "
                           "(it has no metrics.jsonl); give a run's --out\n")


# ---- the figures' content, on small synthetic run directories ----------------------------------------------

def synthetic_run(run_dir: Path, objective="tepo", steps=40, check_every=4, reward_is_strict=True) -> Path:
    """A run directory as train_small.py writes it (config.json, metrics.jsonl and, for TEPO, details.jsonl),
    with made-up values: evaluations at the start, the middle and the end, the entropy check on every
    `check_every`-th step, and TEPO's kl_mask/* only for TEPO."""
    import random
    rng = random.Random(steps * 31 + check_every)
    args = {"objective": objective, "seed": 7, "steps": steps, "task": "arith", "dataset": None, "model": None,
            "n_test": 300, "pass_k": 4, "pass_k_problems": 50, "temperature": 1.0, "entropy_check_every": check_every}
    config = {"args": args, "objective_overrides": {}, "objective_config": {"eps_low": 0.2, "eps_high": 0.28}}
    rows, details = [], []
    for step in range(steps + 1):
        row = {"step": step}
        if step:
            strict = rng.uniform(0.1, 0.6)
            row |= {"reward": strict if reward_is_strict else strict + 0.05, "accuracy/strict": strict,
                    "entropy": rng.uniform(0.1, 0.3), "cov/logp_adv": rng.uniform(-0.01, 0.05),
                    "clip_ratio/low_mean": rng.uniform(0, 0.02), "clip_ratio/high_mean": rng.uniform(0, 0.02),
                    "dynamic_sampling/skipped": 0.0}
            row["clip_ratio/region_mean"] = row["clip_ratio/low_mean"] + row["clip_ratio/high_mean"]
            if step % check_every == 0:
                row |= {"entropy_change/predicted": rng.uniform(-3e-3, 2e-3), "effect/tokens": 1000.0,
                        **{f"effect/{m}/{k}": rng.uniform(0, 1) * (1000 if k == "tokens" else 1)
                           for m in ("clip_low", "kl_mask") for k in ("update_change", "tokens")}}
                row["entropy_change/measured"] = row["entropy_change/predicted"] * 0.8 + rng.uniform(-5e-4, 5e-4)
            if objective == "tepo":
                row |= {"kl_mask/frac": rng.uniform(0.2, 0.5), "kl_mask/penalty": rng.uniform(1e-5, 8e-5)}
                details.append({"step": step, "kl_mask_frac_by_minibatch": [rng.uniform(0.2, 0.5) for _ in range(2)]})
        if step in (0, steps // 2, steps):
            row |= {"eval/accuracy": rng.uniform(0.2, 0.5), "eval/pass@1": 0.3, "eval/pass@2": 0.4,
                    "eval/pass@4": rng.uniform(0.5, 0.7), "eval/mean@4": rng.uniform(0.2, 0.4)}
        rows.append(row)
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if details:
        (run_dir / "details.jsonl").write_text("".join(json.dumps(r) + "\n" for r in details))
    return run_dir


def drawn(run_dir: Path) -> dict:
    """{file name: (figure or the note why there is none, notes)} as python -m tepokit.tools.plot draws them."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plot.draw(plt, plot.read_run(run_dir))


def legend_texts(figure) -> list[str]:
    import matplotlib.legend
    return [t.get_text() for legend in figure.findobj(matplotlib.legend.Legend) for t in legend.get_texts()]


@pytest.fixture
def close_figures():
    yield
    import matplotlib.pyplot as plt
    plt.close("all")


def test_every_figure_names_its_run_and_speaks_in_plain_words(tmp_path, close_figures):
    """Each figure's title says objective, seed, steps and task in one line; no legend entry or panel title is a
    metric key (a word with a '/' inside, like kl_mask/penalty)."""
    figures = drawn(synthetic_run(tmp_path / "run"))
    assert all(not isinstance(figure, str) and notes == [] for figure, notes in figures.values()), figures
    metric_key = re.compile(r"\w/\w")
    for name, (figure, _) in figures.items():
        title = figure.get_suptitle()
        assert title == "tepo, seed 7, 40 steps, task arith", (name, title)
        texts = legend_texts(figure) + [ax.get_title() for ax in figure.axes]
        assert texts and not [t for t in texts if metric_key.search(t)], (name, texts)


def held_out_bars(run_dir, greedy_problems: int, sampled_problems: int):
    """The held-out panel's error bars, each checked against 1.96 sqrt(p(1-p)/n) of the logged p, n being
    greedy_problems for greedy accuracy and sampled_problems for pass@4 and mean@4. Returns the figure and, per
    key, (its legend label, the logged steps, the bar's container)."""
    run = plot.read_run(run_dir)
    figure, _ = drawn(run_dir)["accuracy_reward.png"]
    held = next(ax for ax in figure.axes if ax.get_title() == "Held-out accuracy")
    bars = {}
    for container, label in zip(held.containers, held.get_legend_handles_labels()[1]):
        key_, n = (("eval/accuracy", greedy_problems) if label.startswith("greedy") else
                   ("eval/pass@4", sampled_problems) if "pass@4" in label else ("eval/mean@4", sampled_problems))
        steps, p = plot.series(run, key_)
        bottom_top = np.array([segment[:, 1] for segment in container.lines[2][0].get_segments()])
        assert np.allclose((bottom_top[:, 1] - bottom_top[:, 0]) / 2, 1.96 * np.sqrt(p * (1 - p) / n))
        bars[key_] = (label, steps, container)
    return figure, bars


def test_held_out_points_carry_95_percent_wald_bars_over_the_logged_number_of_problems(tmp_path, close_figures):
    """Greedy accuracy over n_test problems, pass@k and mean@k over min(pass_k_problems, n_test): each bar's
    half-width is 1.96 sqrt(p(1-p)/n) of the logged p."""
    figure, bars = held_out_bars(synthetic_run(tmp_path / "run"), 300, 50)
    for _, steps, container in bars.values():
        assert list(container.lines[0].get_xdata()) == list(steps)
    assert set(bars) == {"eval/accuracy", "eval/pass@4", "eval/mean@4"}
    assert any("95%" in text for text in legend_texts(figure))


def test_the_bars_count_the_problems_each_evaluation_logged(tmp_path, close_figures):
    """A test split smaller than --n-test: the bars and the legend use the logged eval/problems (30) and
    eval/pass_k_problems (20), not n_test (300) and pass_k_problems (50) of config.json."""
    run_dir = synthetic_run(tmp_path / "run")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r | ({"eval/problems": 30, "eval/pass_k_problems": 20} if "eval/accuracy" in r
                                    else {})) + "\n" for r in rows)
    _, bars = held_out_bars(run_dir, 30, 20)
    assert set(bars) == {"eval/accuracy", "eval/pass@4", "eval/mean@4"}
    for key_, (label, _, _) in bars.items():
        assert f", {30 if key_ == 'eval/accuracy' else 20} problems" in label


@pytest.mark.parametrize("reward_is_strict, expected", [
    (True, ["reward (= strict accuracy here)"]), (False, ["reward", "rollout accuracy, strict"])])
def test_the_reward_line_is_drawn_only_where_it_can_be_seen(tmp_path, close_figures, reward_is_strict, expected):
    figure, _ = drawn(synthetic_run(tmp_path / "run", reward_is_strict=reward_is_strict))["accuracy_reward.png"]
    train = next(ax for ax in figure.axes if ax.get_title() == "Training reward")
    assert train.get_legend_handles_labels()[1] == expected
    band = [t for t in legend_texts(figure) if t.startswith("shaded")]
    assert band == (["shaded: \u00b11 s.d. of the single steps in each 4-step window"] if reward_is_strict else [])


@pytest.mark.parametrize("steps, checked", [(40, 10), (12, 3)])
def test_the_entropy_change_figure_has_a_colour_bar_and_states_r_or_too_few_steps(tmp_path, close_figures, steps,
                                                                                    checked):
    """r of predicted vs measured change is tepokit.diagnostics.stats.pearson over the checked steps (every 4th
    here), or 'too few steps' below MIN_STEPS_FOR_R of them; the colour of the points is explained by a bar 'RL
    step'."""
    from tepokit.diagnostics.stats import MIN_STEPS_FOR_R, pearson
    run_dir = synthetic_run(tmp_path / "run", steps=steps)
    run = plot.read_run(run_dir)
    figure, _ = drawn(run_dir)["entropy_change.png"]
    assert [ax.get_ylabel() for ax in figure.axes].count("RL step") == 1            # the colour bar
    r = pearson(list(plot.series(run, "entropy_change/predicted")[1]),
                list(plot.series(run, "entropy_change/measured")[1]), MIN_STEPS_FOR_R)
    titles = [ax.get_title() for ax in figure.axes]
    if checked >= MIN_STEPS_FOR_R:
        assert f"r = {r:.2f} over {checked} checked steps" in titles
    else:
        assert math.isnan(r) and "too few steps for r (fewer than 5 checked)" in titles


def test_the_kl_penalty_is_drawn_on_a_named_power_of_ten(tmp_path, close_figures):
    run_dir = synthetic_run(tmp_path / "run")
    figure, _ = drawn(run_dir)["kl_mask.png"]
    penalty = next(ax for ax in figure.axes if ax.get_title() == "KL penalty on the masked tokens")
    assert penalty.get_ylabel().startswith("$10^{-5}$ nats per token")
    logged = plot.series(plot.read_run(run_dir), "kl_mask/penalty")[1]
    assert np.allclose(penalty.lines[0].get_ydata() * 1e-5, logged)                   # the single steps, faint
    labels = legend_texts(figure)
    assert "1st optimizer step of the rollout\n(policy = old policy: mask cannot act)" in labels


def test_a_grpo_run_with_entropy_checks_every_4th_step_gets_its_figures_and_one_line_per_figure(tmp_path, capsys):
    """No details.jsonl and no kl_mask/* (GRPO), the entropy change on every 4th step only, an unfinished run: the
    figures it can have are written, the KL-mask figure is skipped in one line, and the title says how far the
    run got."""
    run_dir = synthetic_run(tmp_path / "run", objective="grpo")
    config = json.loads((run_dir / "config.json").read_text())
    config["args"]["steps"] = 80
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main([str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(FIGURES) and "kl_mask.png: skipped, no details.jsonl" in lines[2]
    assert sorted(p.name for p in (run_dir / "figures").iterdir()) == sorted(set(FIGURES) - {"kl_mask.png"})
    figures = drawn(run_dir)
    assert figures["entropy.png"][0].get_suptitle() == "grpo, seed 7, 40 of 80 steps, task arith"


def test_the_mechanisms_figure_draws_each_mechanisms_change_and_tokens_in_percent(tmp_path, close_figures):
    """mechanisms.png: one line per mechanism in each panel, at the checked steps, the change of the update and
    the share of tokens it touched in %, with the 5% line; a run without effect/ metrics says why in one line."""
    run_dir = synthetic_run(tmp_path / "run")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    figure, notes = drawn(run_dir)["mechanisms.png"]
    change_ax, tokens_ax = figure.axes
    checked = [r for r in rows if "effect/tokens" in r]
    for ax, key, scale in ((change_ax, "update_change", 100.0), (tokens_ax, "tokens", 100.0 / 1000)):
        lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("5%")}
        assert set(lines) == {"clip_low", "kl_mask"}
        for name, line in lines.items():
            assert list(line.get_xdata()) == [r["step"] for r in checked]
            assert np.allclose(line.get_ydata(), [scale * r[f"effect/{name}/{key}"] for r in checked])
    assert any(line.get_label().startswith("5%") for line in change_ax.get_lines())
    plain = tmp_path / "plain"
    shutil.copytree(run_dir, plain)
    (plain / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("effect/")})
                                                 + "\n" for r in rows))
    note, _ = drawn(plain)["mechanisms.png"]
    assert isinstance(note, str) and "effect/" in note
