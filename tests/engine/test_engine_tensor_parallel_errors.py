"""Whom a failed tensor-parallel step blames: a dead rank, a collective, or rank 0's own code.

The group is built without processes (`__new__`): `call` only reads its workers, its remote ranks
and its config; the real processes' losses are in tests/reliability/test_rel_tensor_parallel.py."""

import pytest
import torch

from mmserve.config import EngineConfig
from mmserve.executor.tensor_parallel import RankLostError, TensorParallelGroup
from mmserve.model.parallel import CollectiveError, ParallelGroup, collective


def _group() -> TensorParallelGroup:
    tp = TensorParallelGroup.__new__(TensorParallelGroup)
    tp.workers, tp.remote, tp.failed = [], [], False
    tp.config = EngineConfig(tensor_parallel_timeout_s=7.0)
    return tp


def test_a_failed_collective_blames_the_collective_and_its_timeout():
    def step():
        collective(_gloo_timeout)

    tp = _group()
    with pytest.raises(RankLostError, match=r"collective failed \(a rank did not answer within 7s.*Timed out"):
        tp.call(step)
    assert tp.failed


def test_an_error_of_rank_0s_own_code_names_it_and_not_a_collective():
    def step():
        raise IndexError("index 9 is out of bounds for dimension 0 with size 4")

    tp = _group()
    with pytest.raises(RankLostError) as err:
        tp.call(step)
    message = str(err.value)
    assert "rank 0 failed outside a collective" in message and "IndexError: index 9" in message
    assert "collective failed" not in message and "did not answer" not in message
    assert tp.failed   # the other ranks wait in that step's collectives: the group is done


def test_an_error_raised_while_handling_a_failed_collective_still_blames_the_collective():
    def step():
        try:
            collective(_gloo_timeout)
        except CollectiveError:
            raise ValueError("cleanup after the collective failed")  # noqa: B904 (the context chain is the point)

    with pytest.raises(RankLostError, match="collective failed"):
        _group().call(step)


def test_only_the_backends_runtime_errors_become_collective_errors():
    with pytest.raises(CollectiveError, match="Timed out") as err:
        collective(_gloo_timeout)
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(TypeError):   # a bad argument is this rank's bug, not a lost peer
        collective(_bad_argument)
    x = torch.ones(3)
    assert ParallelGroup().all_reduce(x) is x   # size 1: no collective at all


def _bad_argument():
    raise TypeError("Invalid function argument")


def _gloo_timeout():
    raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 7000ms for recv operation")
