"""The prompt a gateway routed on, mapped onto ours, so KV events can speak the gateway's tokens.

A gateway that renders the chat template itself (SMG with `mm_processor: inprocess`) sends ONE
anchor token per image, video or audio clip; we expand each into its layout (frame timestamps,
soft-token runs, audio segments), and re-tokenize the text just before a video anchor together with
the first timestamp. So the two prompts agree token for token except in a few runs, each ending at
an anchor on the gateway's side and at the item's last `<image|>` (or `<audio|>`) on ours:
`RoutingPrompt.runs`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingPrompt:
    """`token_ids` as the gateway sent them; `runs`: (start, end) of a run of them (end exclusive, the
    anchor included) and how many of our tokens it became, in order. Every other token is ours one
    for one."""

    token_ids: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...] = ()

    def ours_needed(self) -> list[int]:
        """needed[j]: how many of our leading tokens back the gateway's first j (a run counts whole)."""
        needed, shift, k = [0], 0, 0
        for j in range(1, len(self.token_ids) + 1):
            while k < len(self.runs) and self.runs[k][1] < j:
                start, end, length = self.runs[k]
                shift += length - (end - start)
                k += 1
            if k < len(self.runs) and self.runs[k][0] < j:
                start, end, length = self.runs[k]
                needed.append(start + shift + length)
            else:
                needed.append(j + shift)
        return needed

    def first_run(self) -> int:
        return self.runs[0][0] if self.runs else len(self.token_ids)

    def maps_onto(self, ours: Sequence[int]) -> bool:
        """Whether `ours` is these tokens with each run replaced by that many of ours."""
        i = j = 0
        for start, end, length in (*self.runs, (len(self.token_ids), len(self.token_ids), 0)):
            if start < i or end < start or length < 0 or list(self.token_ids[i:start]) != list(ours[j:j + start - i]):
                return False
            j += start - i + length
            i = end
        return j == len(ours)


def gateway_routing_prompt(gateway_ids: Sequence[int], ours: Sequence[int], mm_ranges: Sequence[tuple[int, int]],
                           anchors: Sequence[tuple[int, int]]) -> RoutingPrompt | None:
    """Map a gateway's prompt onto our expansion of it. `anchors`: (position in `gateway_ids`, how
    many of our ranges that item became: 1 for an image, its frames for a video, its segments for audio), in
    order. None if the two do not line up (then only our own tokens are published)."""
    runs, i, j, r = [], 0, 0, 0
    for at, num_ranges in anchors:
        while i < at and j < len(ours) and gateway_ids[i] == ours[j]:   # the text before it, verbatim
            i, j = i + 1, j + 1
        r += num_ranges
        if num_ranges < 1 or r > len(mm_ranges):
            return None
        end = mm_ranges[r - 1][1] + 2   # past the item's last range and its `<image|>` / `<audio|>`
        if end < j:
            return None
        runs.append((i, at + 1, end - j))
        i, j = at + 1, end
    routing = RoutingPrompt(tuple(gateway_ids), tuple(runs))
    return routing if r == len(mm_ranges) and routing.maps_onto(ours) else None


def media_anchors(gateway_ids: Sequence[int], anchor_ids: Collection[int],
                  ranges_per_item: Sequence[int]) -> list[tuple[int, int]] | None:
    """`gateway_routing_prompt`'s anchors: each anchor of `gateway_ids` (a token of `anchor_ids`), in
    order, with how many of our ranges its item became (1 for a still image, the frames it sampled
    for a video, its segments for audio). None if the counts do not pair with the anchors one to one."""
    at = [i for i, t in enumerate(gateway_ids) if t in anchor_ids]
    if len(at) != len(ranges_per_item):
        return None
    return list(zip(at, ranges_per_item, strict=True))
