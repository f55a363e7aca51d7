"""One-line answers to user mistakes and to the operating system's errors: `fail` (stderr, exit status 2, no
traceback), `warn`, and `os_error_line` (what failed, the path, and what to do)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from tqdm.auto import tqdm

PROGRAM = "train_small.py"       # the command an error line names; python -m tepokit.tools.plot names its own


def fail(message: str, program: str = PROGRAM) -> None:
    """A user mistake: one line on stderr, naming the command (`program`), exit status 2, no traceback."""
    print(f"{program}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def warn(message: str) -> None:
    """One line on stderr, above a progress bar if one is drawn (tqdm.write moves the bar below it)."""
    tqdm.write(f"{PROGRAM}: warning: {message}", file=sys.stderr)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:150]


# What to do about an operating-system error, by its errno.
WHAT_TO_DO = {
    errno.ENOSPC: "free some space on that disk", errno.EDQUOT: "free some space (the disk quota is reached)",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere",
    errno.EROFS: "choose a directory on a writable disk (--out, --cache-dir)",
    errno.EACCES: "choose a directory you can write to (--out, --cache-dir)",
    errno.EPERM: "choose a directory you can write to (--out, --cache-dir)",
    errno.ENAMETOOLONG: "choose a shorter path", errno.ENOTDIR: "a part of the path is a regular file; choose "
    "another path", errno.EIO: "check the disk (is it full?)",
}


def os_error_line(e: OSError) -> str:
    """What failed, the path, and what to do; and, when the path is in a run directory with a checkpoint,
    that the run's last checkpoint is intact and how to continue from it."""
    path = e.filename or "a file"
    line = f"could not write or read {path}: {e.strerror or first_line(e)}; {WHAT_TO_DO.get(e.errno, 'check the path')}"
    folder = os.path.dirname(str(e.filename or ""))
    if e.filename and os.path.isfile(os.path.join(folder, "checkpoint.pt")):
        line += f"; the last checkpoint is intact: continue with python train_small.py --resume {folder}"
    return line


@contextlib.contextmanager
def quiet(log_path: str):
    """Send what the code inside prints (our run's step lines and progress bars, TRL's {'loss': ...} dicts)
    to log_path. If it exits (tepokit.plumbing.errors.fail: a one-line error), that line is repeated on the console."""
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "w") as log:
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
        except SystemExit:
            log.flush()
            lines = open(log_path).read().strip().splitlines()
            if lines:
                print(lines[-1].split("\r")[-1], file=sys.stderr)
            raise
