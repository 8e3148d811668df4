"""`--no-enable-prefix-caching` turns off every reuse across requests: a video sent twice is encoded
and prefilled twice (benchmarks that compare with transformers rely on it)."""

from __future__ import annotations

import random

from test_engine_prefix_cache import engine, process, processor  # noqa: F401  (processor is a fixture)

from mmserve.engine.input.processor import TextInput, VideoInput


def test_without_prefix_caching_a_repeated_video_is_encoded_and_prefilled_again(load_backend, processor,  # noqa: F811
                                                                                 make_video):
    video = make_video(random.randrange(1000), num_frames=4, size=16)
    q1 = process(processor, "q1", VideoInput(data=video, num_frames=3), TextInput("Question: what moves?"))
    q2 = process(processor, "q2", VideoInput(data=video, num_frames=3), TextInput("Question: what moves?"))
    llm, watch = engine(load_backend("reference"), enable_prefix_caching=False)
    first, again = llm.generate([q1])[0], llm.generate([q2])[0]
    assert watch.encoded["q1"] == watch.encoded["q2"] == 3
    assert first.usage.cached_tokens == again.usage.cached_tokens == 0
    assert first.token_ids == again.token_ids
    assert llm.core.runner.encoder_cache.num_bytes == 0
