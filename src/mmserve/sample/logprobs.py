"""Log-probabilities of chosen tokens and their best alternatives, batched over rows.

Computed in float32 from the model's soft-capped logits before anything the sampler changes
(penalties, bias, grammar masks, temperature, top-k/top-p), so they describe the model itself,
as vLLM's default "raw" logprobs do. The engine returns ids and floats; text is the front end's job.
"""

from __future__ import annotations

import torch

from mmserve.ipc.protocol import TokenLogprobs


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logits [R, V] (raw), token_ids [R] chosen per row, num_top[r] alternatives for row r."""
    if not len(num_top):
        return []
    return read_logprobs(logprob_table(logits, token_ids, max(num_top)).cpu(), token_ids.tolist(), num_top)


def logprob_table(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """On the logits' device, float64 [R, 2 + 2k]: each row's chosen logprob, its rank, the top k
    logprobs and their ids (float64 holds the ids exactly), so one transfer brings all of it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.view(-1, 1).to(logp.device)).squeeze(1)
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


def prompt_logprobs(model, hidden: torch.Tensor, scheduled, query_start_loc) -> dict[str, list[TokenLogprobs]]:
    """Logprobs of the prompt tokens this step's chunks predict, for requests that asked for them.

    Row j of a chunk starting at position c predicts prompt token c + j + 1; the result for a
    request is the list for tokens c + 1 .. in order (the caller stores them by position)."""
    out: dict[str, list[TokenLogprobs]] = {}
    for i, s in enumerate(scheduled):
        params = s.request.sampling_params
        end = min(s.seq_len, s.request.num_prompt_tokens - 1)
        if not params.prompt_logprobs or s.num_computed_tokens >= end:
            continue
        first = int(query_start_loc[i])
        targets = s.request.prompt_token_ids[s.num_computed_tokens + 1:end + 1]
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(targets), PROMPT_LOGITS_ROWS):
            chunk = targets[lo:lo + PROMPT_LOGITS_ROWS]
            logits = model.compute_logits(hidden[first + lo:first + lo + len(chunk)])
            ids = torch.tensor(chunk, device=logits.device)
            entries += token_logprobs(logits, ids, [params.top_logprobs] * len(chunk))
        out[s.request.request_id] = entries
    return out
