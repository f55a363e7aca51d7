"""tepokit/tools/tour.py: the tour of tepo.py runs, shows every objective, and its entropy check holds."""
import re

import tepo
from tepokit.tools import tour


def test_the_tour_shows_every_objective_and_the_first_order_entropy_change(capsys):
    tour.main()
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in tepo.OBJECTIVES}
    assert rows == set(tepo.OBJECTIVES)
    predicted, exact = map(float, re.search(r"predicted dH (\S+), exact (\S+)", out).groups())
    assert predicted < 0 and abs(predicted - exact) < 1e-3 * abs(exact)
