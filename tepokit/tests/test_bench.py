"""tepokit/bench.py: --bench without TRL says how to install it."""
import os
import sys

import pytest

import train_small as ts


def test_bench_without_trl_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "trl", None)            # import trl raises ImportError
    with pytest.raises(SystemExit) as e:
        ts.main(["--bench"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "pip install" in err[0] and os.listdir(tmp_path) == []
