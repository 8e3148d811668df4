"""gemma4_unified's encoder-free vision path: 48-px patches straight into the text model.

Per patch (6912 raw values in [0, 1], HWC raster of the 48 x 48 block): LayerNorm -> Linear -> LayerNorm
-> + a factorised position embedding (row x of axis 0 plus row y of axis 1; zero on padding) ->
LayerNorm -> scale-free RMSNorm -> Linear to the text width. One soft token per real patch; padding
patches (position (-1, -1)) are dropped. Module names follow the checkpoint (`vision_embedder.*`,
`embed_vision.embedding_projection`), which transformers renames on load and back on save.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.model.norm import RMSNorm
from mmserve.model.vision import check_patch_inputs


class PatchEmbedder(nn.Module):
    def __init__(self, patch_dim: int, embed_dim: int, posemb_size: int):
        super().__init__()
        self.patch_ln1 = nn.LayerNorm(patch_dim)
        self.patch_dense = nn.Linear(patch_dim, embed_dim)
        self.patch_ln2 = nn.LayerNorm(embed_dim)
        self.pos_embedding = nn.Parameter(torch.zeros(posemb_size, 2, embed_dim))
        self.pos_norm = nn.LayerNorm(embed_dim)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.patch_ln2(self.patch_dense(self.patch_ln1(pixel_values)))
        xy = position_ids.clamp(min=0)
        valid = (position_ids != -1).to(h.dtype)
        pos = (self.pos_embedding[xy[..., 0], 0] * valid[..., 0, None]
               + self.pos_embedding[xy[..., 1], 1] * valid[..., 1, None])
        return self.pos_norm(h + pos)


class Projection(nn.Module):
    def __init__(self, embed_dim: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(embed_dim, eps, with_scale=False)
        self.embedding_projection = nn.Linear(embed_dim, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(x))


class UnifiedVisionEncoder(nn.Module):
    """Same calling convention as `VisionEncoder`: a padded batch in, one tensor per image out."""

    def __init__(self, config):
        super().__init__()
        vc = config.vision_config
        side = vc.patch_size * vc.pooling_kernel_size
        self.vision_embedder = PatchEmbedder(3 * side * side, vc.mm_embed_dim, vc.mm_posemb_size)
        self.embed_vision = Projection(vc.output_proj_dims, config.get_text_config().hidden_size, vc.rms_norm_eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_vision.embedding_projection.weight.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, P, 3*48*48] in [0, 1]; position_ids [n, P, 2] as (x, y), padding (-1, -1)."""
        pixel_values, position_ids = check_patch_inputs(pixel_values, position_ids,
                                                        self.vision_embedder.pos_embedding.shape[0],
                                                        self.embed_vision.embedding_projection.weight)
        real = (position_ids != -1).all(dim=-1)
        embeds = self.embed_vision(self.vision_embedder(pixel_values[real], position_ids[real]))
        return list(torch.split(embeds, real.sum(dim=-1).tolist()))
