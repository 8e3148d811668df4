"""Decode a client's image bytes with Pillow: header checks before pixels, RGB out."""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.multimodal.limits import MediaLimits

FIELD = "image"


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB with transparency composited on white, as transformers' convert_to_rgb does."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(data: bytes, limits: MediaLimits) -> np.ndarray:
    """Decode `data` to uint8 HxWx3. The header's size is checked before any pixel is decoded."""
    if not data:
        raise InvalidInputError(FIELD, "the image payload is empty")
    if len(data) > limits.max_image_bytes:
        raise LimitExceededError(
            f"image is {len(data)} bytes, more than the limit of {limits.max_image_bytes}", "--max-video-bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as probe:
                width, height = probe.size
                if width * height > limits.max_image_pixels:
                    raise LimitExceededError(
                        f"image is {width}x{height} = {width * height} pixels, more than the limit of "
                        f"{limits.max_image_pixels}", "--max-image-pixels")
                probe.verify()
            # verify() leaves the image unusable; open again to decode.
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                rgb = _to_rgb(img)
    except LimitExceededError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise LimitExceededError(f"image looks like a decompression bomb: {e}", "--max-image-pixels") from e
    except Exception as e:  # noqa: BLE001 - any Pillow failure is the payload's fault
        raise InvalidInputError(FIELD, f"cannot decode the image: {type(e).__name__}: {e}") from e
    if rgb.width == 0 or rgb.height == 0:
        raise InvalidInputError(FIELD, "the image has no pixels")
    return np.asarray(rgb, dtype=np.uint8)
