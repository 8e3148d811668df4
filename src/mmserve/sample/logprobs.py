"""Log-probabilities of chosen tokens and their best alternatives, batched over rows.

Computed in float32 from the model's soft-capped logits before anything the sampler changes
(penalties, bias, grammar masks, temperature, top-k/top-p), so they describe the model itself,
as vLLM's default "raw" logprobs do. The engine returns ids and floats; text is the front end's job.
Nothing here reads the device: tables start their own pinned, non-blocking copy to the host
(`HostCopy`), read once the step's tokens are (one step late in the async loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.attention.buffers import HostCopy
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sample.row_values import device_ids


def logprob_table(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """On the logits' device, float64 [R, 2 + 2k]: each row's chosen logprob, its rank, the top k
    logprobs and their ids (float64 holds the ids exactly), so one transfer brings all of it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1)).squeeze(1)   # token_ids: on the logits' device
    rank = (logp > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = (torch.topk(logp, k, dim=-1, sorted=True) if k else (logp[:, :0], logp[:, :0].long()))
    parts = [chosen.unsqueeze(1), rank.unsqueeze(1), top_vals, top_ids]
    return torch.cat([p.double() for p in parts], dim=1)


def read_logprobs(host: torch.Tensor, ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """`logprob_table`'s rows, on the host, as TokenLogprobs (row r keeps its num_top[r] best)."""
    k = (host.shape[1] - 2) // 2
    out = []
    for r, n in enumerate(num_top):
        row = host[r]
        out.append(TokenLogprobs(
            token_id=ids[r], logprob=float(row[0]), rank=int(row[1]),
            top_ids=tuple(int(x) for x in row[2 + k:2 + k + n].tolist()),
            top_logprobs=tuple(row[2:2 + n].tolist())))
    return out


PROMPT_LOGITS_ROWS = 512   # rows of prompt logits materialised at once ([rows, vocab] float32)


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs on their way to the host: per request chunk, its table's copy (one
    pinned, non-blocking transfer, started as the table is queued), the prompt ids it scores and the
    alternatives asked for. `result()` waits for those copies alone."""

    parts: list[tuple[str, HostCopy, list[int], int]] = field(default_factory=list)

    def result(self) -> dict[str, list[TokenLogprobs]]:
        """request id -> logprobs of the prompt tokens after its chunk's start, in order."""
        out: dict[str, list[TokenLogprobs]] = {}
        for rid, copy, ids, num_top in self.parts:
            out.setdefault(rid, []).extend(read_logprobs(copy.result(), ids, [num_top] * len(ids)))
        return out


def prompt_logprobs(model, hidden: torch.Tensor, scheduled, query_start_loc) -> PromptLogprobs:
    """Logprobs of the prompt tokens this step's chunks predict, for requests that asked for them,
    queued on the device and on their way to the host.

    Row j of a chunk starting at position c predicts prompt token c + j + 1; the result for a
    request is the list for tokens c + 1 .. in order (the caller stores them by position)."""
    out = PromptLogprobs()
    for i, s in enumerate(scheduled):
        params = s.request.sampling_params
        if not params.prompt_logprobs:
            continue
        end = min(s.seq_len, s.request.num_prompt_tokens - 1)
        if s.num_computed_tokens >= end:
            continue
        first = int(query_start_loc[i])
        targets = s.request.prompt_token_ids[s.num_computed_tokens + 1:end + 1]
        for lo in range(0, len(targets), PROMPT_LOGITS_ROWS):
            chunk = list(targets[lo:lo + PROMPT_LOGITS_ROWS])
            logits = model.compute_logits(hidden[first + lo:first + lo + len(chunk)])
            ids = device_ids(chunk, logits.device)
            table = logprob_table(logits, ids, params.top_logprobs)
            out.parts.append((s.request.request_id, HostCopy(table), chunk, params.top_logprobs))
    return out
