"""tepokit/diagnostics/band.py: which completions the clip takes out of the update, by item, strategy and sign."""
import math

import torch

import tepo
from tepokit.diagnostics.band import band_clips, clipped_rows

F64 = torch.float64


def test_a_sequence_ratio_clips_whole_rows_that_left_the_band_the_way_their_advantage_pushes():
    """GSPO's band (1 - 3e-4, 1 + 4e-4) on the geometric-mean ratio: row 0 rose with A > 0 (clipped), row 1 fell with
    A < 0 (clipped), row 2 rose with A < 0 and row 3 fell with A > 0 (kept: they moved against their advantage),
    row 4 rose with A > 0 but inside the band (kept). One token far out does not clip a row whose mean is inside."""
    cfg = tepo.config_for("tepo", beta=0.0)
    mask = torch.ones(5, 4, dtype=F64)
    old = torch.full((5, 4), -1.0, dtype=F64)
    shift = torch.tensor([1e-3, -1e-3, 1e-3, -1e-3, 1e-4], dtype=F64)        # mean log-ratio per row
    logp = old + shift.unsqueeze(-1)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=F64)
    assert clipped_rows("tepo", cfg, logp, old, adv, mask).tolist() == [True, True, False, False, False]
    one_token = logp.clone()
    one_token[4, 0] += 4 * 3e-4          # the row's mean log-ratio: 1e-4 + 3e-4 = 4e-4, above log(1 + 4e-4)
    assert math.log(1 + 4e-4) < 4e-4
    assert clipped_rows("tepo", cfg, one_token, old, adv, mask).tolist()[4]
    one_token[4, 0] -= 3e-4              # mean 3.25e-4: inside the band although one token's ratio is 1 + 1e-3
    assert not clipped_rows("tepo", cfg, one_token, old, adv, mask).tolist()[4]
    # GRPO's token ratio: a row counts as clipped when any token leaves (0.8, 1.2) the way A pushes
    grpo = tepo.config_for("grpo", beta=0.0)
    far = old.clone()
    far[0, 2] += math.log(1.3)
    assert clipped_rows("grpo", grpo, far, old, adv, mask).tolist() == [True, False, False, False, False]
    # GMPO's band is in log space, (-0.4, 0.4) for the log-ratio: log 1.3 = 0.26 is inside it, 0.45 is not
    gmpo = tepo.config_for("gmpo")
    assert clipped_rows("gmpo", gmpo, far, old, adv, mask).tolist() == [False] * 5
    far[0, 2] = old[0, 2] + 0.45
    assert clipped_rows("gmpo", gmpo, far, old, adv, mask).tolist() == [True, False, False, False, False]


def test_band_counts_rows_by_item_strategy_and_sign_after_the_first_optimizer_step():
    """Two optimizer steps of 3 rows each: only the second is counted; its rows are counted under their labels, a
    row with A = 0 not at all, and the clipped ones as such."""
    cfg = tepo.config_for("tepo", beta=0.0)
    B, T = 6, 3
    mask = torch.ones(B, T)
    old = torch.full((B, T), -1.0)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 0.0])
    logp = old + torch.tensor([0.0, 0, 0, 1e-2, 1e-2, 1e-2]).unsqueeze(-1)   # rows 3-5 rose after step 1
    first, second = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])
    loss_saw = [[(first, logp[first], None)], [(second, logp[second], None)]]
    strategies = ["add", "mul", None, "mul", "add", "add"]
    items = ["add", "add", "mul", "mul", "mul", "add"]
    counts = band_clips("tepo", cfg, loss_saw, old, adv, mask, strategies, items)
    nonzero = {k: v for k, v in counts.items() if v}
    assert nonzero == {"band/mul_item/mul/pos/rows": 1.0, "band/mul_item/mul/pos/clipped": 1.0,   # rose, A > 0
                       "band/mul_item/add/neg/rows": 1.0}                                          # rose, A < 0
    assert len(counts) == 2 * 3 * 2 * 2
    no_cue = band_clips("tepo", cfg, loss_saw, old, adv, mask, strategies, None)
    assert no_cue["band/any_item/mul/pos/clipped"] == 1.0 and len(no_cue) == 3 * 2 * 2
    assert band_clips("kl_cov", tepo.config_for("kl_cov"), loss_saw, old, adv, mask, strategies, items) == {}
    assert band_clips("cispo", tepo.config_for("cispo"), loss_saw, old, adv, mask, strategies, items) == {}  # none out
