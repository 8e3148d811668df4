"""Media preprocessed by the real SMG (pinned `smg`) and sent as `mm_inputs`, into one replica that
runs `--gateway-media gateway` (it advertises no media processor, so SMG runs its own Gemma 4
processor instead of forwarding `media_refs`).

SMG 1.13.0's Gemma 4 processor takes only 70..1120 soft tokens per image, so the checkpoint is the
demo model with its processor configs set to 70 (the weights do not depend on it). An image through
SMG must give the same prompt and greedy answer as the same image through our own `mmserve.v1`
(our decoder and preprocessing). SMG decodes video with an ffmpeg executable, which this machine
lacks: a video is refused by SMG itself (400 naming ffmpeg), the proof that SMG preprocesses here."""

from __future__ import annotations

import json
import shutil

import grpc
import openai
import pytest
from gateway_cases import assert_same, media_request, png
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import Fleet

from mmserve.clients import Client
from mmserve.clients.messages import message
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.tokenizer import load_tokenizer

SOFT_TOKENS = 70   # the smallest image budget SMG's Gemma 4 processor accepts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo70") / "demo_model"
    shutil.copytree(DEMO_MODEL_DIR, root)
    for name, key in (("preprocessor_config.json", "max_soft_tokens"), ("video_preprocessor_config.json",
                                                                         "max_soft_tokens"),
                      ("processor_config.json", "image_seq_length")):
        config = json.loads((root / name).read_text())
        config[key] = SOFT_TOKENS
        (root / name).write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def fleet(checkpoint):
    with Fleet(1, policy="round_robin", model=checkpoint, replica_args=("--gateway-media", "gateway"),
               in_process=1) as f:
        yield f


def test_an_image_preprocessed_by_smg_answers_as_through_mmserve_v1(fleet, checkpoint):
    with grpc.insecure_channel(fleet.replicas[0].address) as channel:
        info = vpb_grpc.VllmEngineStub(channel).GetServerInfo(vpb.GetServerInfoRequest(), timeout=30)
    assert info.mm_processor == ""   # what makes SMG preprocess
    image = png(5, size=64)
    v1_parts, content = media_request("What is shown here?", image=image)
    with Client(fleet.replicas[0].address) as c:
        ours = c.generate([message("user", *v1_parts)], max_tokens=12, temperature=0, logprobs=True)
    reply = fleet.openai().chat.completions.create(model=fleet.model_id(), temperature=0, max_tokens=12,
                                                   logprobs=True, messages=[{"role": "user", "content": content}])
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens
    assert_same(reply.choices[0], ours, load_tokenizer(checkpoint))


def test_smg_decodes_video_itself_and_needs_ffmpeg_for_it(fleet, make_video):
    _, content = media_request("What happens?", video=make_video(3, num_frames=8))
    if shutil.which("ffmpeg"):
        pytest.skip("ffmpeg is installed here: SMG would decode the video (this test pins the machine's lack of it)")
    with pytest.raises(openai.BadRequestError, match="ffmpeg"):
        fleet.openai().chat.completions.create(model=fleet.model_id(), temperature=0, max_tokens=4,
                                               messages=[{"role": "user", "content": content}])
