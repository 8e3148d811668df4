"""Engine outputs -> VllmEngine response messages, as vLLM's own servicer shapes them.

Streaming: one chunk per delta (token ids, their logprobs, `completion_tokens` = the delta's count),
then, as each sample ends, a `complete` repeating its last delta with the finish reason and usage
(a sample other than 0 that ends first holds its `complete` until sample 0 ends, then sends it just
before sample 0's, in the same batch: `SampleEnds`).
Not streaming: one `complete` per sample with all its ids and logprobs. `index` names the sample.
The gateway detokenizes the ids itself; our text is not sent. The frames each video sampled (what
mmserve.v1 reports in `Final.videos`) have no field in the protocol: they leave as the call's trailing
metadata `mmserve-video-frames` (`sampled_frames`).
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.engine.types import RequestOutput
from mmserve.ipc.protocol import TokenLogprobs

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
VIDEO_FRAMES_KEY = "mmserve-video-frames"


def sampled_frames(frames: dict[int, int]) -> tuple[tuple[str, str], ...]:
    """Trailing metadata naming how many frames each video sampled (`media_refs.frames_per_item`):
    `ITEM=FRAMES` per video, ITEM its index in `media_refs.items` (images have none), comma-separated:
    `0=8,2=4`. A few bytes per video, so the request's frame bound keeps it far below any metadata limit."""
    entries = [f"{item}={n}" for item, n in sorted(frames.items())]
    return ((VIDEO_FRAMES_KEY, ",".join(entries)),) if entries else ()


def output_logprobs(entries: Sequence[TokenLogprobs] | None, with_top: bool) -> vpb.OutputLogProbs | None:
    if not entries:
        return None
    return vpb.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries], token_ids=[e.token_id for e in entries],
        top_logprobs=[vpb.TopLogProbs(values=e.top_logprobs, token_ids=e.top_ids) for e in entries] if with_top else [])


def input_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs] | None,
                   with_top: bool) -> vpb.InputLogProbs | None:
    """The first prompt token has no logprob: entries are aligned to the end of the prompt."""
    if entries is None:
        return None
    missing = len(prompt_ids) - len(entries)
    values = [vpb.InputTokenLogProb()] * missing + [vpb.InputTokenLogProb(value=e.logprob) for e in entries]
    top = [vpb.TopLogProbs()] * missing + [vpb.TopLogProbs(values=e.top_logprobs, token_ids=e.top_ids)
                                           for e in entries]
    return vpb.InputLogProbs(token_logprobs=values, token_ids=list(prompt_ids), top_logprobs=top if with_top else [])


def chunk(index: int, out: RequestOutput, prompt_tokens: int, with_top: bool) -> vpb.GenerateResponse:
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=out.new_token_ids, prompt_tokens=prompt_tokens, completion_tokens=len(out.new_token_ids),
        output_logprobs=output_logprobs(out.new_logprobs, with_top), index=index))


def complete(index: int, last: RequestOutput, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
             prompt_ids: Sequence[int], with_top: bool, first: RequestOutput) -> vpb.GenerateResponse:
    """`last` is the sample's finished output, `first` sample 0's; `token_ids`/`logprobs` what this
    message carries. The prompt's cached tokens and logprobs are the request's, which sample 0 computed:
    the other samples fork its prompt KV (engine/parallel_sampling.py), so their own usage counts it
    as a cache hit and they compute no prompt logprobs (vLLM gives every output the same ones)."""
    usage = last.usage
    message = vpb.GenerateComplete(
        output_ids=token_ids, finish_reason=FINISH_REASONS.get(last.finish_reason or "", "stop"),
        prompt_tokens=usage.prompt_tokens if usage else len(prompt_ids), completion_tokens=len(token_ids),
        cached_tokens=first.usage.cached_tokens if first.usage else 0,
        output_logprobs=output_logprobs(logprobs, with_top),
        input_logprobs=input_logprobs(prompt_ids, first.prompt_logprobs, with_top), index=index)
    if last.finish_reason == "stop" and last.matched_stop:
        message.matched_stop_str = last.matched_stop
    elif last.finish_reason == "eos" and token_ids:
        message.matched_token_id = token_ids[-1]
    return vpb.GenerateResponse(complete=message)


class SampleEnds:
    """Each sample's `complete`, once sample 0 has ended (`complete` reads its prompt's cached tokens
    and logprobs): a sample that ends first waits for it. `ends` holds every sample's finished output."""

    def __init__(self, prompt_ids: Sequence[int], with_top: bool) -> None:
        self._prompt_ids = prompt_ids
        self._with_top = with_top
        self._waiting: list[tuple[int, RequestOutput, list[int], list[TokenLogprobs] | None]] = []
        self.ends: dict[int, RequestOutput] = {}

    def finished(self, index: int, last: RequestOutput, token_ids: list[int],
                 logprobs: list[TokenLogprobs] | None) -> list[vpb.GenerateResponse]:
        """The `complete` messages to send now: none while sample 0 runs, else this one and any waiting."""
        self.ends[index] = last
        self._waiting.append((index, last, token_ids, logprobs))
        first = self.ends.get(0)
        if first is None:
            return []
        ready, self._waiting = self._waiting, []
        return [complete(i, out, ids, lps, self._prompt_ids, self._with_top, first) for i, out, ids, lps in ready]
