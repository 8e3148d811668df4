"""GetModelInfo, GetServerInfo and GetLoads: what a gateway registers a worker by and balances on.

SMG reads these at registration (GetServerInfo's fields become the worker's labels) and polls
GetLoads every few seconds. The model's paths are deliberately not filesystem paths: a gateway tries
an advertised path as a local directory and then as a Hugging Face Hub id (off the machine), so we
advertise the served name only and let it fetch the tokenizer with GetTokenizer.
"""

from __future__ import annotations

import datetime
import time

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

import mmserve
from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.types import ModelInfo
from mmserve.ipc.protocol import LoadInfo
from mmserve.model.spec import ModelSpec
from mmserve.server.vllm_engine.media_refs import schemes
from mmserve.server.vllm_engine.sampling import CheckpointDefaults

SERVER_TYPE = "vllm-grpc"
MM_PROCESSOR = "inprocess"   # we accept media_refs and expand the anchors ourselves (--gateway-media worker)


def model_info(info: ModelInfo, spec: ModelSpec, defaults: CheckpointDefaults) -> vpb.GetModelInfoResponse:
    return vpb.GetModelInfoResponse(
        model_path=info.name, tokenizer_path=info.name, served_model_name=info.name, is_generation=True,
        max_context_length=info.context_length, max_req_input_len=info.context_length - 1,
        vocab_size=spec.vocab_size, supports_vision=spec.has_vision, model_type=spec.model_type,
        architectures=["Gemma4ForConditionalGeneration"], eos_token_ids=list(spec.eos_token_ids),
        pad_token_id=spec.pad_token_id, bos_token_id=spec.bos_token_id,
        default_sampling_params_json=defaults.as_json())


def server_info(engine_config: EngineConfig, server_config: ServerConfig, info: ModelInfo, spec: ModelSpec, *,
                active: int, draining: bool, started: float, last_request: float) -> vpb.GetServerInfoResponse:
    vision = spec.has_vision
    ours = vision and server_config.gateway_media == "worker"   # else the gateway preprocesses (mm_inputs)
    # What admission refuses beyond, sorted by modality: audio clips and images by their own counts,
    # videos by the frames of the request (each video counts one frame at least, before decoding).
    limits = f"image={engine_config.max_images_per_request},video={engine_config.max_frames_per_request}"
    if spec.has_audio:
        limits = f"audio={engine_config.max_audio_per_request},{limits}"
    return vpb.GetServerInfoResponse(
        active_requests=active, is_paused=draining, last_receive_timestamp=last_request,
        uptime_seconds=time.monotonic() - started, server_type=SERVER_TYPE, data_parallel_size=1,
        block_size=engine_config.block_size, attention_backend=info.backend, model_dtype=f"torch.{info.dtype}",
        mm_processor=MM_PROCESSOR if ours else "",
        mm_media_ref_schemes=schemes(server_config.allowed_local_media_path) if ours else "",
        mm_processor_source="default" if ours else "",
        max_num_seqs=engine_config.max_num_seqs, mm_item_limits=limits if vision else "",
        multimodal_encoder_dtype=info.dtype if vision else "",
        mm_encoder_budget=engine_config.max_num_batched_tokens if vision else 0)


def loads(load: LoadInfo) -> vpb.GetLoadsResponse:
    return vpb.GetLoadsResponse(
        timestamp=datetime.datetime.now(datetime.UTC).isoformat(), version=mmserve.__version__, dp_rank_count=1,
        loads=[vpb.SchedulerLoad(dp_rank=0, num_running_reqs=load.running, num_waiting_reqs=load.waiting,
                                 num_total_reqs=load.running + load.waiting, token_usage=load.kv_usage,
                                 utilization=load.kv_usage, max_running_requests=load.max_num_seqs)])
