"""SubscribeKvEvents and FlushCache on a real server (a replica's `serve` options, in-process: demo
model, its own engine process), through the VllmEngine stub a gateway uses. The events are applied the way SMG's cache_aware index
applies them (a block sits at its parent's position + 1; a request matches block by block from 0 on
each block's tokens), and a video request sent as a gateway sends it (one `<|video|>` anchor in the
ids, the clip as a `data:` URL) must match on the gateway's own ids: that is what routes its
follow-ups to this replica; with two videos too."""

from __future__ import annotations

import base64
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import InProcessReplica

from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.synthetic import make_clip

BLOCK = 16   # the server's default --block-size


@pytest.fixture(scope="module")
def replica():
    server = InProcessReplica("--kv-cache-bytes", str(8 * 2**20))
    try:
        server.wait_ready(time.monotonic() + 180)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stub(replica):
    with grpc.insecure_channel(replica.address) as channel:
        yield vpb_grpc.VllmEngineStub(channel)


class RouterIndex:
    def __init__(self):
        self.blocks: dict[int, tuple[int, tuple[int, ...]]] = {}

    def apply(self, batch: common_pb2.KvEventBatch) -> None:
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
            elif kind == "removed":
                for h in event.removed.block_hashes:
                    self.blocks.pop(h, None)
            else:
                stored = event.stored
                assert stored.kv_cache_spec_kind == "full_attention"
                pos = 0
                if stored.HasField("parent_block_hash"):
                    assert stored.parent_block_hash in self.blocks, "a block published before its parent"
                    pos = self.blocks[stored.parent_block_hash][0] + 1
                for block in stored.blocks:
                    assert block.block_size == BLOCK and len(block.token_ids) == BLOCK
                    self.blocks[block.block_hash] = (pos, tuple(block.token_ids))
                    pos += 1

    def match(self, ids) -> int:
        have = {v for v in self.blocks.values()}
        n = 0
        while (n + 1) * BLOCK <= len(ids) and (n, tuple(ids[n * BLOCK:(n + 1) * BLOCK])) in have:
            n += 1
        return n


def chat_ids(tok, spec, parts: list) -> list[int]:
    """A user turn as SMG renders the demo template: text encoded, media as one anchor each."""
    ids = [spec.bos_token_id, tok.token_id("<|turn>")] + tok.encode("user\n")
    for p in parts:
        ids += [spec.video_token_id] if p == "video" else tok.encode(p)
    return ids + [tok.token_id("<turn|>")] + tok.encode("\n") + [tok.token_id("<|turn>")] + tok.encode("model\n")


def generate(stub, rid: str, ids: list[int], *videos: bytes) -> vpb.GenerateComplete:
    req = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=False,
                              sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=3, top_p=1.0))
    for video in videos:
        url = "data:video/mp4;base64," + base64.b64encode(video).decode()
        req.media_refs.items.add(modality=common_pb2.VIDEO, url=url)
    responses = list(stub.Generate(req, timeout=120))
    return responses[-1].complete


def read_until(stream, index: RouterIndex, done, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the events did not arrive"
        index.apply(next(stream))


def test_events_speak_the_gateway_tokens_and_flush_clears_them(stub):
    tok, spec = load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True),
                                    timeout=300)
    index = RouterIndex()
    text = chat_ids(tok, spec, ["Count the red squares in the picture, then say which way they move." * 2])
    generate(stub, "text-1", text)
    read_until(stream, index, lambda: index.match(text) == len(text) // BLOCK)

    clip = make_clip(5, num_frames=4).data
    about = "Look at this clip carefully, from its first frame to its last. What colour is the shape? "
    first = chat_ids(tok, spec, ["video", about + "Answer in one word please."])
    out = generate(stub, "video-1", first, clip)
    shift = out.prompt_tokens - len(first)   # the anchor became frames on our side
    assert shift > 0
    # A gateway block is published once the block of ours its last token lands in is cached: the
    # prompt's whole blocks (the text after the anchor maps one for one, `shift` further on).
    backed = ((out.prompt_tokens // BLOCK) * BLOCK - shift) // BLOCK
    read_until(stream, index, lambda: index.match(first) == backed)

    follow = chat_ids(tok, spec, ["video", about + "Which way does it move?"])
    shared = next(i for i, (a, b) in enumerate(zip(first, follow, strict=False)) if a != b) // BLOCK
    assert index.match(follow) >= min(shared, backed) >= 2, "a follow-up on the same video matches the gateway's ids"
    again = generate(stub, "video-2", follow, clip)
    assert again.cached_tokens >= out.prompt_tokens - len(first) , "the follow-up reused the video's KV"

    late = RouterIndex()   # a new subscriber starts from a snapshot of the same state
    snapshot = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)
    late.apply(next(snapshot))
    snapshot.cancel()
    read_until(stream, index, lambda: set(index.blocks) >= set(late.blocks))
    assert late.match(first) == index.match(first) and late.match(text) == index.match(text)

    flushed = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=30), timeout=60)
    assert flushed.success, flushed.message
    read_until(stream, index, lambda: not index.blocks)
    assert generate(stub, "video-3", follow, clip).cached_tokens == 0
    stream.cancel()


def test_two_videos_are_published_in_the_gateway_tokens(stub):
    """Each video's own frame count maps the gateway's prompt onto ours (4 frames sampled from one
    clip, 2 from the other), so the published blocks match the gateway's ids past both anchors."""
    tok, spec = load_tokenizer(DEMO_MODEL_DIR), load_spec(DEMO_MODEL_DIR)
    stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=90)   # a miss fails, not hangs
    index = RouterIndex()
    index.apply(next(stream))   # the snapshot: events run from here
    words = "Compare the two clips: which one moves faster, and which way do both of their shapes go? "
    ids = chat_ids(tok, spec, ["First clip:", "video", "second clip:", "video", words * 2])
    out = generate(stub, "two-videos", ids, make_clip(7, num_frames=8).data, make_clip(8, num_frames=2).data)
    shift = out.prompt_tokens - len(ids)
    backed = min(len(ids), (out.prompt_tokens // BLOCK) * BLOCK - shift) // BLOCK
    second_anchor = [i for i, t in enumerate(ids) if t == spec.video_token_id][1]
    assert backed > second_anchor // BLOCK + 1
    read_until(stream, index, lambda: index.match(ids) >= backed)
    stream.cancel()


def test_flush_timeout_out_of_range_is_invalid_argument(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s" in err.value.details()
