"""Plain results the clients return, and the one exception type they raise."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
from google.rpc import error_details_pb2, status_pb2

from mmserve.api import pb

FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_STOP_STRING: "stop",
}


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, its rank (1 = most likely) and the most likely alternatives."""

    token_id: int
    text: str
    logprob: float
    rank: int
    top: tuple[TopLogprob, ...] = ()


def logprobs_from(messages) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(m.token_id, m.text, m.logprob, m.rank,
                              tuple(TopLogprob(t.token_id, t.text, t.logprob) for t in m.top)) for m in messages)


@dataclass(frozen=True)
class MediaRef:
    """Media uploaded to a server (`Client.upload`): pass it as `video=` or `image=`. `id` is the
    sha256 of the bytes; `source` is the file it came from, so the client can upload it again
    when the server no longer has it (None for an uploaded file object)."""

    id: str
    size_bytes: int = 0
    mime_type: str = ""
    ttl_s: float = 0.0
    source: Path | None = None

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True)
class Delta:
    """New tokens and the text they decode to, as the stream produces them (and their logprobs
    when the request asked for them)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0          # the sample (sampling n > 1)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    multimodal_tokens: int = 0
    completion_tokens: int = 0
    num_frames: int = 0
    cached_tokens: int = 0  # prompt tokens served from the server's prefix cache


@dataclass(frozen=True)
class Timings:
    """Seconds from the request's arrival at the server; TTFT includes `preprocess_s` (decoding media)."""

    queue_s: float = 0.0
    time_to_first_token_s: float = 0.0
    end_to_end_s: float = 0.0
    preprocess_s: float = 0.0


@dataclass(frozen=True)
class SampledVideo:
    """The frames the server sampled from one video part (`part`, e.g. "messages[0].parts[0]")."""

    part: str
    num_frames: int
    timestamps_s: tuple[float, ...]
    duration_s: float = 0.0


@dataclass(frozen=True)
class Perf:
    flops: float = 0.0
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    mfu: float = 0.0
    mbu: float = 0.0
    attn_flops_sliding: float = 0.0
    attn_flops_full: float = 0.0


@dataclass(frozen=True)
class Sample:
    """One of a request's n samples: its tokens and how it ended."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    matched_stop: str = ""
    completion_tokens: int = 0
    finish_detail: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerateResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "length" | "eos" | "stop"
    matched_stop: str = ""
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    perf: Perf = field(default_factory=Perf)
    logprobs: tuple[TokenLogprob, ...] = ()         # one per token, with sampling logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., with prompt_logprobs
    finish_detail: str = ""
    samples: tuple[Sample, ...] = ()    # with n > 1 every sample (the fields above are sample 0's)
    videos: tuple[SampledVideo, ...] = ()  # per video part: the frames sampled and their timestamps


def _copy_fields(cls, message):
    """`cls` filled from the proto `message` fields of the same names (each dataclass mirrors one)."""
    return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


def _sample(index: int, deltas: list[Delta], end: pb.SampleFinal) -> Sample:
    mine = [d for d in deltas if d.index == index]
    return Sample(index, "".join(d.text for d in mine), tuple(t for d in mine for t in d.token_ids),
                  FINISH_REASONS.get(end.finish_reason, "unspecified"), end.matched_stop, end.completion_tokens,
                  end.finish_detail, tuple(lp for d in mine for lp in d.logprobs))


def result_from(request_id: str, deltas: list[Delta], final: pb.Final) -> GenerateResult:
    first = [d for d in deltas if d.index == 0]
    return GenerateResult(
        request_id=request_id,
        text="".join(d.text for d in first),
        token_ids=tuple(t for d in first for t in d.token_ids),
        finish_reason=FINISH_REASONS.get(final.finish_reason, "unspecified"),
        matched_stop=final.matched_stop,
        usage=_copy_fields(Usage, final.usage),
        timings=_copy_fields(Timings, final.timings),
        perf=_copy_fields(Perf, final.perf),
        logprobs=tuple(lp for d in first for lp in d.logprobs),
        prompt_logprobs=logprobs_from(final.prompt_logprobs),
        finish_detail=final.finish_detail,
        samples=tuple(_sample(end.index, deltas, end) for end in final.samples),
        videos=tuple(SampledVideo(v.part, v.num_frames, tuple(v.timestamps_s), v.duration_s) for v in final.videos),
    )


class ClientError(Exception):
    """A failed call: the gRPC status code and message, plus the server's structured hints."""

    def __init__(self, code: grpc.StatusCode, message: str, *, field: str = "",
                 retry_delay_s: float | None = None, resource_name: str = ""):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field  # the offending request field for INVALID_ARGUMENT
        self.retry_delay_s = retry_delay_s  # set when the server says retrying later may succeed
        self.resource_name = resource_name  # what was missing for NOT_FOUND (e.g. a media id)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ClientError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        message = error.details() if hasattr(error, "details") else str(error)
        field_name, retry, resource = "", None, ""
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        for key, value in trailers or ():
            if key != "grpc-status-details-bin":
                continue
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad = error_details_pb2.BadRequest()
                    detail.Unpack(bad)
                    field_name = bad.field_violations[0].field if bad.field_violations else ""
                elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    retry = info.retry_delay.ToTimedelta().total_seconds()
                elif detail.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
                    found = error_details_pb2.ResourceInfo()
                    detail.Unpack(found)
                    resource = found.resource_name
        return cls(code or grpc.StatusCode.UNKNOWN, message or "", field=field_name, retry_delay_s=retry,
                   resource_name=resource)
