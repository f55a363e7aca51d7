"""The learning rate of the band-with-SGD arm (docs/collapse.md, "Why the band explores"): the one that gives plain
SGD's steps the norm that Adam's steps had, measured on the baseline's first steps.

Runs `tepo:beta=0` on the cue variant (seed 1, the baseline run's settings) for 40 RL steps with Adam and records,
at each optimizer step, the norm of the parameters' change and of the gradient after clipping (max norm 1). SGD's
change is lr x that gradient, so lr = |change| / |clipped gradient| / (Adam's lr at that step) x --lr gives SGD
steps of Adam's size. Prints the median over the optimizer steps of RL steps 21-40 (after the lr warm-up).

    python notebooks/logs/band_mechanism_2026-11-27/sgd_learning_rate.py     # about a minute on one CPU thread
"""
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..")))
import train_small  # noqa: E402
from tepokit.cli import flags  # noqa: E402


def main() -> None:
    out = os.path.join(tempfile.mkdtemp(), "run")
    argv = ["--task", "hidden-type", "--cue", "0.9", "--objective", "tepo", "--beta", "0", "--seed", "1",
            "--threads", "1", "--steps", "40", "--out", out]
    args, overrides = flags.parse_args(train_small.Args, argv)
    run = train_small.start_run(args, overrides)
    ratios = []
    for step in range(1, 41):
        lr = train_small.learning_rate(step, run.args)
        before, grads = [], []

        def observe(i, n, batch, micro_batches, model):      # before optimizer step i: its gradient, unclipped
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
            grads.append(min(norm.item(), run.args.max_grad_norm))
            before.append([p.detach().clone() for p in model.parameters()])
        train_small.rl_step(run, step, observe=observe)
        after = before[1:] + [[p.detach() for p in run.model.parameters()]]
        for b, a, g in zip(before, after, grads):
            change = torch.sqrt(sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b))).item()
            if step > run.args.lr_warmup_steps and g > 0:
                ratios.append(change / g / lr)
    factor = statistics.median(ratios)
    print(f"optimizer steps measured: {len(ratios)}; |Adam's change| / |clipped gradient| / lr: median {factor:.1f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.1f}, {statistics.quantiles(ratios, n=4)[2]:.1f})")
    print(f"SGD's learning rate for Adam's step size at --lr {run.args.lr:g}: {factor * run.args.lr:.3g}")


if __name__ == "__main__":
    main()
