"""Builders for request messages, so callers never assemble protos by hand.

Parts keep their order: `user_message("Describe the video.", video=clip)` puts the media first and
the text after it, the layout the demo model was trained on; pass parts explicitly with
`message("user", video_part(a), text_part("and"), video_part(b))` for anything else.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmserve.api import pb
from mmserve.clients.types import MediaRef


def text_part(text: str) -> pb.Part:
    return pb.Part(text=text)


def image_part(data: bytes | MediaRef, mime_type: str = "") -> pb.Part:
    """An image as encoded bytes, or uploaded (`Client.upload`)."""
    if isinstance(data, MediaRef):
        return pb.Part(image=pb.Image(media_id=data.id, mime_type=mime_type))
    return pb.Part(image=pb.Image(data=data, mime_type=mime_type))


def video_part(data: bytes | MediaRef, mime_type: str = "", *, num_frames: int = 0, fps: float = 0.0,
               start_s: float = 0.0, end_s: float = 0.0) -> pb.Part:
    """A video as container bytes, or uploaded (`Client.upload`); num_frames/fps = 0 leave frame
    sampling to the server; start_s/end_s sample only that window (end_s 0 = to the end)."""
    video = pb.Video(mime_type=mime_type, num_frames=num_frames, fps=fps, start_s=start_s, end_s=end_s)
    if isinstance(data, MediaRef):
        video.media_id = data.id
    else:
        video.data = data
    return pb.Part(video=video)


def audio_part(data: bytes | MediaRef, mime_type: str = "", *, start_s: float = 0.0, end_s: float = 0.0) -> pb.Part:
    """An audio clip (WAV, FLAC, MP3, Ogg, M4A, WebM) as bytes, or uploaded (`Client.upload`);
    start_s/end_s: hear only that window (end_s 0 = to the end)."""
    audio = pb.Audio(mime_type=mime_type, start_s=start_s, end_s=end_s)
    if isinstance(data, MediaRef):
        audio.media_id = data.id
    else:
        audio.data = data
    return pb.Part(audio=audio)


def frames_part(frames: Sequence[bytes], fps: float = 0.0, mime_type: str = "") -> pb.Part:
    """A video given as already decoded frame images (PNG/JPEG bytes); fps sets their timestamps."""
    images = [pb.Image(data=f, mime_type=mime_type) for f in frames]
    return pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=images, fps=fps)))


def message(role: str, *parts: pb.Part) -> pb.Message:
    return pb.Message(role=role, parts=list(parts))


def user_message(text: str | None = None, *, video: bytes | MediaRef | None = None,
                 image: bytes | MediaRef | None = None, audio: bytes | MediaRef | None = None,
                 video_mime_type: str = "", image_mime_type: str = "", num_frames: int = 0, fps: float = 0.0,
                 start_s: float = 0.0, end_s: float = 0.0) -> pb.Message:
    """One user turn: image, then video, then audio, then text (each optional)."""
    parts = []
    if image is not None:
        parts.append(image_part(image, image_mime_type))
    if video is not None:
        parts.append(video_part(video, video_mime_type, num_frames=num_frames, fps=fps, start_s=start_s, end_s=end_s))
    if audio is not None:
        parts.append(audio_part(audio))
    if text is not None:
        parts.append(text_part(text))
    return message("user", *parts)
