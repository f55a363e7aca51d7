"""One optimizer step's loss metrics from its micro-batches' (train_small.py, update_policy)."""

from __future__ import annotations


def combine_micro_batches(parts: list[tuple[dict, int]]) -> dict:
    """One mini-batch's metrics from its micro-batches' (metrics, valid tokens): the loss and its parts
    add up (each micro-batch's loss is its share of the mini-batch's); ratio extremes and the sampler correction's
    weight extremes (sampler_correction/weight_min, _max) are extremes;
    on_policy holds if it held everywhere; every other metric is a token-weighted mean."""
    total = sum(n for _, n in parts) or 1
    out = {}
    for key in parts[0][0]:
        values = [m[key] for m, _ in parts]
        if key in ("loss", "pg_loss", "kl_loss"):
            out[key] = sum(values)
        elif key in ("ratio/min", "on_policy", "sampler_correction/weight_min"):
            out[key] = min(values)
        elif key in ("ratio/max", "sampler_correction/weight_max"):
            out[key] = max(values)
        else:
            out[key] = sum(v * n for v, (_, n) in zip(values, parts)) / total
    return out
