"""When a request stops, and which text the client may see so far.

Text is held back while its tail could still turn into a stop string, so a streamed stop string
never reaches the client; the final output drops it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopDecision:
    finish_reason: str | None     # "eos" | "stop" | "length" | None (keep going)
    matched_stop: str | None
    visible_len: int              # characters of the text that may be shown now


def check_stop(params: SamplingParams, token_id: int, num_output_tokens: int, text: str, searched_from: int,
               eos_token_ids: frozenset[int]) -> StopDecision:
    """`text` is everything detokenized so far; stop strings are searched from `searched_from` on
    (a little before the newest delta, so a string split over two deltas is found), and only once
    the output has `min_tokens` tokens."""
    if params.stop and num_output_tokens >= params.min_tokens:
        hits = [(idx, s) for s in params.stop if (idx := text.find(s, searched_from)) >= 0]
        if hits:
            idx, s = min(hits)
            return StopDecision("stop", s, idx)
    if token_id in eos_token_ids and not params.ignore_eos:
        return StopDecision("eos", None, len(text))
    if num_output_tokens >= params.max_tokens:
        return StopDecision("length", None, len(text))
    hold = max((len(s) for s in params.stop), default=1) - 1
    return StopDecision(None, None, max(0, len(text) - hold))
