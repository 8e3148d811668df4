"""Decode a client's audio with PyAV into what Gemma 4's audio tower hears: mono float32 samples at
the feature extractor's rate, cut into segments of at most 30 s, each turned into log-mel features.

Work is bounded before it is done: the container's declared duration is read from its header and a
clip (or window) longer than `--max-audio-duration-s` is refused before a sample is decoded; while
decoding, a clip whose header lied is stopped once it has given that many seconds, and a
`DecodeControl` is checked between packets (time limit, cancel). Formats are sniffed from magic
bytes (WAV, FLAC, MP3, Ogg, M4A/MP4, WebM/Matroska, AAC) and the demuxer is forced
(multimodal/container.py). A video's soundtrack (use_audio_in_video) comes through `read_track` on
the container the video decoder already opened.

Silence is refused: a clip whose every sample is below -80 dBFS (0.0001) gives the model nothing to
hear, and is far more often a muted or broken capture than a question about silence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import av
import numpy as np
import torch

from mmserve.errors import InvalidInputError, LimitExceededError, RequestAbortedError
from mmserve.multimodal.container import MediaSource, declared_length_s, open_container, read_head
from mmserve.multimodal.decode_control import DecodeControl
from mmserve.multimodal.limits import MediaLimits

FIELD = "audio"
SILENCE = 1e-4          # peak amplitude below which a clip is silent (-80 dBFS)
SLACK_S = 1.0           # decoded audio may exceed the declared duration by this much (rounding)
HEAD_BYTES = 256        # read for sniffing, and for a WAV's chunk headers
# What a header may declare: FFmpeg fails on more channels with a bare errno (avcodec_open2 22), and a
# sample rate of 2^31 Hz ran the resampler out of memory. 768 kHz is the highest PCM rate recorded;
# 64 channels, 7th-order ambisonics.
MAX_SAMPLE_RATE = 768_000
MAX_CHANNELS = 64


@dataclass
class DecodedAudio:
    """`samples`: mono float32 in [-1, 1] at `rate`, the window's; `duration_s`: the whole clip's, as
    its header declares it (or as decoded, when it declares none)."""

    samples: np.ndarray
    rate: int
    duration_s: float
    start_s: float = 0.0


@dataclass
class Segment:
    """At most 30 s of a clip as the tower takes it: log-mel features of its real frames only."""

    features: torch.Tensor   # [mel frames, bins] float32
    num_soft_tokens: int
    start_s: float           # seconds from the clip's start (a soundtrack: from the video's first frame)


def sniff_audio(head: bytes) -> str | None:
    """FFmpeg demuxer name for the audio containers we accept, or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) >= 12 and head[4:8] == b"ftyp":
        return "mov"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        return "aac" if head[1] & 0x06 == 0 else "mp3"   # ADTS has layer bits 00, MPEG audio does not
    return None


def _format(head: bytes) -> str:
    fmt = sniff_audio(head)
    if fmt is None:
        raise InvalidInputError(FIELD, "unsupported or unrecognised audio format (send WAV, FLAC, MP3, Ogg, M4A or "
                                "WebM)")
    return fmt


def audio_stream(container: av.container.InputContainer, limits: MediaLimits, what: str = "audio", head: bytes = b""):
    """The first audio stream, refused by its codec, channel count, sample rate and declared duration
    (`head`: the file's first bytes) before any decoding."""
    if not container.streams.audio:
        raise InvalidInputError(FIELD, f"the {what} has no audio stream")
    stream = container.streams.audio[0]
    if stream.codec_context is None:
        raise InvalidInputError(FIELD, f"unsupported audio codec in the {what}: no decoder for it here")
    channels, rate = _wav_layout(head) or (stream.codec_context.channels, stream.codec_context.sample_rate)
    if channels > MAX_CHANNELS:
        raise InvalidInputError(FIELD, f"the {what} has {channels} channels; at most {MAX_CHANNELS} are decoded")
    if rate > MAX_SAMPLE_RATE:
        raise InvalidInputError(FIELD, f"the {what}'s sample rate is {rate} Hz; at most {MAX_SAMPLE_RATE} Hz is "
                                       "decoded")
    stream.codec_context.thread_count = 1
    declared = declared_duration(container, stream, head)
    if declared is not None:
        check_duration(declared, limits, what)
    return stream


def declared_duration(container: av.container.InputContainer, stream, head: bytes = b"") -> float | None:
    """What the header says. FFmpeg clamps a WAV's data size to the file's, so a WAV's own `data`
    chunk size is read from `head` too: a header claiming hours is refused, not believed or ignored."""
    wav = _wav_declared_s(head)
    if wav is not None:
        return wav
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    return declared_length_s(container)


def _wav_chunks(head: bytes):
    """(kind, body offset, size) of each RIFF/WAVE chunk whose header lies in `head`."""
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return
    at = 12
    while at + 8 <= len(head):
        size = _u32(head, at + 4)
        yield head[at:at + 4], at + 8, size
        at += 8 + size + (size & 1)


def _u32(head: bytes, at: int) -> int:
    return int.from_bytes(head[at:at + 4], "little")


def _wav_declared_s(head: bytes) -> float | None:
    """Seconds a RIFF/WAVE header's `data` chunk declares (its size over the `fmt ` byte rate)."""
    byte_rate = 0
    for kind, body, size in _wav_chunks(head):
        if kind == b"fmt " and body + 8 <= len(head):
            byte_rate = _u32(head, body + 8)
        if kind == b"data":
            return size / byte_rate if byte_rate and size != 0xFFFFFFFF else None   # 0xFFFFFFFF: streamed
    return None


def _wav_layout(head: bytes) -> tuple[int, int] | None:
    """(channels, sample rate) a WAV's `fmt ` chunk declares: FFmpeg reports no channels past 512."""
    for kind, body, _ in _wav_chunks(head):
        if kind == b"fmt " and body + 8 <= len(head):
            return int.from_bytes(head[body + 2:body + 4], "little"), _u32(head, body + 4)
    return None


def check_duration(seconds: float, limits: MediaLimits, what: str = "audio") -> None:
    if seconds > limits.max_audio_duration_s:
        raise LimitExceededError(f"the {what} lasts {seconds:.1f} s, longer than the limit of "
                                 f"{limits.max_audio_duration_s:g} s of audio", "--max-audio-duration-s")


def read_track(container: av.container.InputContainer, stream, *, rate: int, begin_s: float, end_s: float | None,
               limits: MediaLimits, control: DecodeControl, rewind: bool = False) -> np.ndarray:
    """The stream's samples in [begin_s, end_s) (seconds on the container's clock; None = to the
    end), downmixed to mono and resampled to `rate` by libswresample. Stops at the duration limit
    however long the stream really is. `rewind`: seek even to the start (a container already read)."""
    tb = stream.time_base
    if (begin_s > 0 or rewind) and tb:
        container.seek(max(0, math.floor(begin_s / tb)), stream=stream, backward=True)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    cap = int((limits.max_audio_duration_s + SLACK_S) * rate)
    chunks: list[np.ndarray] = []
    total = 0
    first: float | None = None   # the time of the first decoded sample

    def keep(frames) -> None:
        nonlocal total
        for out in frames:
            chunk = out.to_ndarray().reshape(-1)
            chunks.append(chunk)
            total += chunk.size
        if total > cap:
            raise LimitExceededError(f"the audio decodes to more than {limits.max_audio_duration_s:g} s (its header "
                                     "declared less)", "--max-audio-duration-s")

    done = False
    for packet in container.demux(stream):
        control.check()
        for frame in packet.decode():
            if first is None:
                first = float(frame.time) if frame.time is not None else begin_s
            keep(resampler.resample(frame))
            done = end_s is not None and first + total / rate >= end_s
            if done:
                break
        if done:
            break
    keep(resampler.resample(None))
    samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)
    if first is None:
        return samples
    lo = max(0, round((begin_s - first) * rate))
    hi = samples.size if end_s is None else max(lo, round((end_s - first) * rate))
    return np.ascontiguousarray(samples[lo:hi], dtype=np.float32)


def decode_audio(source: MediaSource, *, rate: int, start_s: float = 0.0, end_s: float | None = None,
                 limits: MediaLimits, control: DecodeControl | None = None) -> DecodedAudio:
    """Decode `source` (bytes or a path) to mono float32 at `rate`, the window [start_s, end_s) only
    (seconds from the clip's start; None = to the end). Raises InvalidInputError for undecodable,
    empty or silent input, LimitExceededError for the size and duration limits,
    RequestAbortedError when cancelled."""
    control = control or DecodeControl()
    if isinstance(source, bytes):
        if not source:
            raise InvalidInputError(FIELD, "the audio payload is empty")
        if len(source) > limits.max_video_bytes:
            raise LimitExceededError(f"audio is {len(source)} bytes, more than the media limit of "
                                     f"{limits.max_video_bytes}", "--max-video-bytes")
    control.check()
    head = read_head(source, HEAD_BYTES)
    fmt = _format(head)
    try:
        with open_container(source, fmt) as container:
            stream = audio_stream(container, limits, head=head)
            duration = declared_duration(container, stream, head)
            if duration == 0:
                raise InvalidInputError(FIELD, "the audio holds no samples")
            if duration is not None and start_s >= duration:
                raise InvalidInputError(FIELD, f"start_s {start_s:g} is at or past the end of the audio, which lasts "
                                        f"{duration:.3f} s")
            origin = float(stream.start_time * stream.time_base) if stream.start_time and stream.time_base else 0.0
            samples = read_track(container, stream, rate=rate, begin_s=origin + start_s,
                                 end_s=None if end_s is None else origin + end_s, limits=limits, control=control)
    except (InvalidInputError, LimitExceededError, RequestAbortedError):
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the payload's fault, never a crash
        raise InvalidInputError(FIELD, f"cannot decode the audio: {type(e).__name__}: {e}") from e
    check_audible(samples, rate)
    return DecodedAudio(samples, rate, duration if duration is not None else start_s + samples.size / rate, start_s)


def probe_duration(source: MediaSource, limits: MediaLimits) -> float | None:
    """The clip's declared duration from its header (nothing decoded), refused over the limit; None
    when the header declares none. For the input processor's checks before any decoding."""
    head = read_head(source, HEAD_BYTES)
    fmt = _format(head)
    try:
        with open_container(source, fmt) as container:
            return declared_duration(container, audio_stream(container, limits, head=head), head)
    except (InvalidInputError, LimitExceededError):
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable header is the payload's fault
        raise InvalidInputError(FIELD, f"cannot read the audio: {type(e).__name__}: {e}") from e


def check_audible(samples: np.ndarray, rate: int, what: str = "the audio") -> None:
    if not samples.size:
        raise InvalidInputError(FIELD, f"{what} holds no samples")
    if damaged := int(np.count_nonzero(~np.isfinite(samples))):   # a NaN peak would pass the silence check below
        raise InvalidInputError(FIELD, f"{what} holds {damaged} samples that are not "
                                "finite numbers (NaN or infinity): its encoder wrote damaged floats; re-encode it")
    if float(np.abs(samples).max()) < SILENCE:
        raise InvalidInputError(FIELD, f"{what} is silent ({samples.size / rate:.2f} s, every sample below "
                                "-80 dBFS): there is nothing to hear")


class AudioFeaturizer:
    """Cuts samples into segments of at most `segment_samples` (30 s) and computes each one's log-mel
    features with transformers' Gemma 4 feature extractor (the model's own preprocessing, as the
    vision path uses the model's own resize rule). A tail too short for one mel frame is dropped."""

    def __init__(self, spec) -> None:
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

        self.spec = spec
        self.extractor = Gemma4AudioFeatureExtractor(**spec.feature_extractor)

    def segments(self, samples: np.ndarray, start_s: float = 0.0, control: DecodeControl | None = None
                 ) -> list[Segment]:
        spec, out = self.spec, []
        step = spec.segment_samples
        for begin in range(0, samples.size, step):
            if control is not None:
                control.check()
            piece = samples[begin:begin + step]
            tokens = spec.num_soft_tokens(piece.size)
            if tokens < 1:
                continue
            batch = self.extractor([piece], max_length=step, truncation=True, return_tensors="np")
            frames = int(batch["input_features_mask"][0].sum())
            features = torch.from_numpy(np.ascontiguousarray(batch["input_features"][0][:frames]))
            out.append(Segment(features, tokens, start_s + begin / spec.sampling_rate))
        if not out:
            raise InvalidInputError(FIELD, f"the audio is too short: {samples.size} samples at "
                                    f"{spec.sampling_rate} Hz give no {spec.ms_per_token} ms token")
        return out
