"""One-line answers to user mistakes: `fail` (stderr, exit status 2, no traceback) and `warn`."""

from __future__ import annotations

import sys

def fail(message: str) -> None:
    """A user mistake: one line on stderr, exit status 2, no traceback."""
    print(f"train_small.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def warn(message: str) -> None:
    print(f"train_small.py: warning: {message}", file=sys.stderr)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:150]
