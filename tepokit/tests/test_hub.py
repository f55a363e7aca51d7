"""tepokit/plumbing/hub.py: an unreachable hub found in seconds, and said in one line."""
import os
import subprocess
import sys
import time

import tepokit.plumbing.hub
from tepokit.plumbing.hub import HUB_PROBE_SECONDS, use_offline_hub_if_unreachable
from tepokit.tests.helpers import SCRIPT


def test_unreachable_hub_is_detected_in_seconds(monkeypatch):
    """A hub that accepts the connection but never answers (a local socket nobody serves) is given up
    after HUB_PROBE_SECONDS, and the hub libraries are switched to offline mode so loading fails at once."""
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    assert HUB_PROBE_SECONDS < 10
    monkeypatch.setattr(tepokit.plumbing.hub, "HUB_PROBE_SECONDS", 2)      # the same path, faster
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TEPO_HUB_UNREACHABLE", raising=False)
    for module in ("huggingface_hub.constants", "datasets.config"):
        if module in sys.modules:
            monkeypatch.setattr(sys.modules[module], "HF_HUB_OFFLINE", sys.modules[module].HF_HUB_OFFLINE)
    t0 = time.time()
    reason = use_offline_hub_if_unreachable()
    silent.close()
    assert 2 <= time.time() - t0 < 10 and "unreachable" in reason and os.environ["HF_HUB_OFFLINE"] == "1"
    assert use_offline_hub_if_unreachable() == reason              # later loads: no probe, the same reason


def test_unreachable_hub_is_one_line_in_a_real_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    t0 = time.time()
    out = subprocess.run([sys.executable, SCRIPT, "--model", "gpt2", "--steps", "1"], capture_output=True,
                         text=True, timeout=180, env=env, cwd=tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "unreachable" in lines[0], out.stderr
    assert "without --model" in lines[0] and os.listdir(tmp_path) == []
    print(f"unreachable hub reported in {time.time() - t0:.1f} s (process start included)")
