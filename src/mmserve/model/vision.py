"""Vision: transformers' Gemma 4 vision tower + multimodal embedder, used as they are.

We do not rewrite the ViT: the modules come from transformers and load the checkpoint's
`vision_tower.*` / `embed_vision.*` tensors. This wrapper only fixes the calling convention the
engine needs: a batch of patchified images/frames in, one [soft_tokens_i, text_hidden] tensor out
per image (padding patches have position (-1, -1) and produce no tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Gemma4Config
from transformers.initialization import no_init_weights
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel


def pad_patches(items: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch per-image (pixel_values [P_i, C], position_ids [P_i, 2]) for `encode_vision`: pad to the
    longest with zero pixels at position (-1, -1), which the tower ignores."""
    longest = max(p.shape[0] for p, _ in items)
    first = items[0][0]
    pixels = first.new_zeros(len(items), longest, first.shape[1])
    positions = torch.full((len(items), longest, 2), -1, dtype=torch.long, device=first.device)
    for i, (p, q) in enumerate(items):
        pixels[i, : p.shape[0]] = p
        positions[i, : q.shape[0]] = q
    return pixels, positions


def check_patch_inputs(pixel_values: torch.Tensor, position_ids: torch.Tensor, table_size: int,
                       weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision encoder's padded batch, checked and moved where it runs (either encoder's forward):
    pixel_values [n, P, C] and position_ids [n, P, 2], or ValueError; positions outside [0,
    table_size) other than padding's (-1, -1) are refused before they index the tower's position
    table: past it a GPU raises a device-side assert that ends the whole engine, not one request
    (checked on the host tensor, before the copy to the device). Returns the pixels in `weight`'s
    device and dtype and the positions as long on that device."""
    if pixel_values.dim() != 3 or position_ids.shape != (*pixel_values.shape[:2], 2):
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)} / position_ids "
                         f"{tuple(position_ids.shape)}: expected [n, P, C] and [n, P, 2]")
    if position_ids.numel() and (int(position_ids.max()) >= table_size or int(position_ids.min()) < -1):
        raise ValueError(f"patch positions must lie in [0, {table_size}) (padding (-1, -1)); got "
                         f"[{int(position_ids.min())}, {int(position_ids.max())}]")
    return (pixel_values.to(device=weight.device, dtype=weight.dtype),
            position_ids.to(device=weight.device, dtype=torch.long))


class VisionEncoder(nn.Module):
    def __init__(self, config: Gemma4Config, attn_implementation: str = "sdpa"):
        super().__init__()
        vision_config = config.vision_config
        vision_config._attn_implementation = attn_implementation
        # Parameters are overwritten by the checkpoint; skip the (slow) random init. Buffers such as
        # the 2D-RoPE inverse frequencies stay float32, as transformers keeps them.
        with no_init_weights():
            self.vision_tower = Gemma4VisionModel(vision_config)
            self.embed_vision = Gemma4MultimodalEmbedder(vision_config, config.get_text_config())
        self.k_squared = vision_config.pooling_kernel_size ** 2

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_vision.embedding_projection.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, P, 3*p*p] in [0, 1]; position_ids [n, P, 2] as (x, y), padding (-1, -1)."""
        pixel_values, position_ids = check_patch_inputs(pixel_values, position_ids,
                                                        self.vision_tower.patch_embedder.position_embedding_size,
                                                        self.embed_vision.embedding_projection.weight)
        extra = -pixel_values.shape[1] % self.k_squared   # the pooler needs P = k^2 * slots
        if extra:
            pixel_values = F.pad(pixel_values, (0, 0, 0, extra))
            position_ids = F.pad(position_ids, (0, 0, 0, extra), value=-1)
        features = self.vision_tower(pixel_values=pixel_values, pixel_position_ids=position_ids).last_hidden_state
        embeds = self.embed_vision(inputs_embeds=features)
        tokens = ((position_ids != -1).all(dim=-1).sum(dim=-1) // self.k_squared).tolist()
        return list(torch.split(embeds, tokens))
