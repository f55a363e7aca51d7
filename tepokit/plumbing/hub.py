"""The Hugging Face hub: found unreachable in seconds (then loading is offline), the one line said when a
model or data set cannot be had, and transformers' own progress bars kept off the console where they say nothing."""

from __future__ import annotations

import contextlib
import os
import sys
import urllib.error
import urllib.request

from tepokit.plumbing.errors import fail, first_line

HUB_PROBE_SECONDS = 5


def cannot_load(what: str, name: str, e: Exception, offline_reason: str | None, instead: str) -> None:
    """One line for a model or dataset that could not be loaded: the unreachable hub when that is why."""
    why = f"{offline_reason}, and it is not in the local cache" if offline_reason else \
        f"{type(e).__name__}: {first_line(e)}"
    fail(f"could not load {what} {name!r}: {why}; {instead}")


def use_offline_hub_if_unreachable() -> str | None:
    """Probe the Hugging Face hub (at most HUB_PROBE_SECONDS). If it does not answer, switch the hub
    libraries to offline mode, so loading uses the local cache at once instead of retrying for a
    minute, and return why (for the error message); None if the hub answered. Once offline mode is on,
    no probe: the reason is returned if a probe turned it on (TEPO_HUB_UNREACHABLE), else None."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return os.environ.get("TEPO_HUB_UNREACHABLE")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=HUB_PROBE_SECONDS).close()
        return None
    except urllib.error.HTTPError:      # it answered, even if with an error status
        return None
    except Exception as e:  # noqa: BLE001 -- no network, DNS, timeout, proxy: all mean "unreachable"
        reason = f"the Hugging Face hub ({endpoint}) is unreachable ({first_line(getattr(e, 'reason', e))})"
    os.environ["HF_HUB_OFFLINE"], os.environ["TEPO_HUB_UNREACHABLE"] = "1", reason
    for module in ("huggingface_hub.constants", "datasets.config"):     # read the variable when imported
        if module in sys.modules:
            sys.modules[module].HF_HUB_OFFLINE = True
    return reason


@contextlib.contextmanager
def without_transformers_bars(when: bool = True):
    """transformers' progress bars ("Loading weights", "Writing model shards") off inside the block (if `when`):
    for the built-in model and for our own saves they flash by in milliseconds and tell the user nothing. Our
    bars (warm-up, RL steps) are not transformers' and stay. transformers turns the hub's download bars off with
    its own, so loading a real model (`when` False) keeps them: its download and load take a while."""
    from transformers.utils import logging
    was_on = logging.is_progress_bar_enabled()
    if when:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
