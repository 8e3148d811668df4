"""Real audio made in the test, encoded by PyAV: tone sequences (no download, no speech engine), clips
with a lying or empty header, and video containers with a soundtrack.

`tones(seed, seconds)` is a sequence of random pure tones at 16 kHz as int16 samples; encoding them
as WAV (pcm_s16le) is lossless, so a reference can start from these samples exactly.
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np

RATE = 16_000


def tones(seed: int, seconds: float, rate: int = RATE, *, notes_per_s: float = 4.0) -> np.ndarray:
    """int16 mono: random tones (200-2000 Hz), a new one every 1/notes_per_s s, at half scale."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    note = max(1, int(rate / notes_per_s))
    freqs = np.repeat(rng.uniform(200, 2000, -(-n // note)), note)[:n]
    phase = 2 * np.pi * np.cumsum(freqs) / rate
    return (0.5 * 32767 * np.sin(phase)).astype(np.int16)


def encode(samples: np.ndarray, rate: int = RATE, *, fmt: str = "wav", codec: str = "pcm_s16le",
           channels: int = 1) -> bytes:
    """Encode int16 mono samples (copied to every channel) with PyAV."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        layout = "mono" if channels == 1 else "stereo"
        stream = container.add_stream(codec, rate=rate, layout=layout)
        data = np.repeat(samples[None, :], channels, axis=0) if channels > 1 else samples[None, :]
        frame_size = stream.codec_context.frame_size or 1024
        encoder_format = stream.codec_context.format.name
        resampler = av.AudioResampler(format=encoder_format, layout=layout, rate=rate)
        for start in range(0, data.shape[1], frame_size):
            chunk = np.ascontiguousarray(data[:, start:start + frame_size])
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1) if channels > 1 else chunk, format="s16",
                                               layout=layout)
            frame.rate = rate
            for f in resampler.resample(frame):
                for packet in stream.encode(f):
                    container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    return encode(samples, rate)


def wav_declaring(seconds: float, real_samples: int, rate: int = RATE) -> bytes:
    """A WAV whose header declares `seconds` of 16-bit mono audio but holds `real_samples` of it."""
    declared = int(seconds * rate) * 2
    header = (b"RIFF" + struct.pack("<I", 36 + declared) + b"WAVE" + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
              rate * 2, 2, 16) + b"data" + struct.pack("<I", declared))
    return header + tones(1, real_samples / rate, rate).tobytes()


def wav_with_layout(channels: int, rate: int, frames: int = 100) -> bytes:
    """A 16-bit PCM WAV declaring `channels` and `rate` (the byte rate wraps at 32 bits as a writer's
    would), holding `frames` sample frames of tones on every channel."""
    data = np.repeat(tones(2, frames / RATE)[:, None], channels, axis=1).tobytes()
    block = 2 * channels
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 1, channels, rate, (rate * block) % 2**32, block, 16) + b"data" +
            struct.pack("<I", len(data)) + data)


def wav_f32(samples: np.ndarray, rate: int = RATE) -> bytes:
    """float32 mono samples as a pcm_f32le WAV, written by hand: NaN and infinity go in as they are."""
    data = samples.astype("<f4").tobytes()
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE" + b"fmt " +
            struct.pack("<IHHIIHH", 16, 3, 1, rate, rate * 4, 4, 32) + b"data" + struct.pack("<I", len(data)) + data)


def av_clip(frames: list[np.ndarray], fps: float, samples: np.ndarray | None, rate: int = RATE, *,
            fmt: str = "matroska") -> bytes:
    """A video of `frames` (HxWx3 uint8) at `fps` with `samples` (int16 mono) as lossless PCM sound
    (none: a silent-less video without an audio stream), in Matroska: both streams start at 0."""
    out = io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        video = container.add_stream("mpeg4", rate=int(fps)) if frames else None
        if video is not None:
            video.width, video.height = frames[0].shape[1], frames[0].shape[0]
            video.pix_fmt = "yuv420p"
            video.options = {"qscale": "2"}
        audio = container.add_stream("pcm_s16le", rate=rate, layout="mono") if samples is not None else None
        for image in frames:
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        if audio is not None:
            for start in range(0, samples.size, 1024):
                frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None, start:start + 1024]),
                                                   format="s16", layout="mono")
                frame.rate, frame.pts = rate, start
                for packet in audio.encode(frame):
                    container.mux(packet)
            for packet in audio.encode(None):
                container.mux(packet)
        if video is not None:
            for packet in video.encode(None):
                container.mux(packet)
    return out.getvalue()
