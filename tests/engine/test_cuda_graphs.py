"""Decode CUDA graphs: which steps and sizes take a graph (CPU), and capture/replay on a GPU."""

from __future__ import annotations

import pytest
import torch

from mmserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, is_decode_only


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    graphs = DecodeGraphs(capture_sizes(20), enabled=True)
    assert [graphs.size_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 20, 20, None]


def test_disabled_graphs_run_everything_eagerly():
    graphs = DecodeGraphs(capture_sizes(64), enabled=False)
    assert not graphs.enabled and graphs.size_for(1) is None


def test_only_one_token_per_request_without_frames_is_a_decode_step():
    assert is_decode_only([1, 1, 1], has_frames=False)
    assert not is_decode_only([1, 2], has_frames=False)
    assert not is_decode_only([1], has_frames=True)
    assert not is_decode_only([], has_frames=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replay_reads_the_persistent_inputs_of_its_size():
    x = torch.zeros(8, 4, device="cuda")
    weight = torch.randn(4, 4, device="cuda")
    graphs = DecodeGraphs((2, 8), enabled=True)
    graphs.capture_all(lambda size: (lambda: torch.tanh(x[:size] @ weight)))
    for size in (2, 8):
        x.copy_(torch.randn_like(x))
        out = graphs.replay(size)
        torch.testing.assert_close(out, torch.tanh(x[:size] @ weight))
