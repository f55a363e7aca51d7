"""Fixtures shared by the tests in this folder."""
import os

import pytest


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One working directory for the module, so the micro warm-up is cached once (runs/cache)."""
    d = tmp_path_factory.mktemp("train_small")
    old = os.getcwd()
    os.chdir(d)
    yield d
    os.chdir(old)
