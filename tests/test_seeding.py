"""tests/conftest.py's seeding: a test's draws come from (the salt, its node id), whatever ran before it."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch


@pytest.fixture
def conftest(request):
    """The tests/conftest.py module pytest loaded (sys.modules' "conftest" is the last folder's)."""
    return request.config.pluginmanager.get_plugin(str(Path(__file__).with_name("conftest.py")))


def _draws() -> tuple[int, int, int]:
    return int(torch.randint(0, 2**62, ())), int(np.random.randint(2**31)), random.getrandbits(64)


def test_a_tests_draws_are_its_salt_and_node_ids_whatever_was_drawn_before(request, conftest):
    at_start = _draws()
    torch.rand(100), np.random.rand(7), random.random()   # as an earlier test in this process would
    conftest._seed_generators(request.node.nodeid)
    assert _draws() == at_start


def test_another_salt_or_test_draws_otherwise(request, monkeypatch, conftest):
    conftest._seed_generators(request.node.nodeid)
    here = _draws()
    conftest._seed_generators(request.node.nodeid + "x")
    assert all(a != b for a, b in zip(_draws(), here, strict=True))
    monkeypatch.setattr(conftest, "SEED_SALT", conftest.SEED_SALT + 1)
    conftest._seed_generators(request.node.nodeid)
    assert all(a != b for a, b in zip(_draws(), here, strict=True))
