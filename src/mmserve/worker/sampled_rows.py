"""The step reduced to the rows that sample, for KV-sharing layers (Gemma 4 E2B/E4B).

A KV-sharing layer writes no KV, so once the last KV-writing layer has run, a row whose logits the
step does not sample feeds nothing: the KV-sharing layers (E2B: 20 of 35) can run on the sampled
rows alone (each sampling request's last row; none for a prefill chunk that does not end its
prompt). This builds those rows' attention metadata with a second `StepInputBuilder` (sized by
max_num_seqs, persistent buffers like the step's own) and a second set of backend builders.
Steps where every row samples (pure decode) or that need every row's hidden state (prompt
logprobs) keep the full path.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mmserve.attention import PoolConfig
from mmserve.core.sched.output import ScheduledRequest
from mmserve.model.decoder import SampledRows
from mmserve.worker.step_inputs import PrevStep, StepInputBuilder, StepInputs


class SampledRowsBuilder:
    def __init__(self, spec, backends: dict, pools: dict[str, PoolConfig], *, max_num_seqs: int, max_blocks: int,
                 block_size: int, device):
        self.inputs = StepInputBuilder(spec.attention_specs, max_num_tokens=max_num_seqs, max_num_seqs=max_num_seqs,
                                       max_blocks_per_req=max_blocks, block_size=block_size, device=device)
        self.builders = {t: backends[t].builder_cls(dataclasses.replace(pool, max_num_tokens=max_num_seqs))
                         for t, pool in pools.items()}

    def build(self, scheduled: list[ScheduledRequest], step: StepInputs, block_tables: dict[str, np.ndarray],
              rows: np.ndarray, prev: PrevStep | None = None) -> SampledRows | None:
        """The sampled rows of `step` and their metadata, or None when the full path is as cheap or needed."""
        if step.num_tokens == len(step.sampling_index) or any(s.request.sampling_params.prompt_logprobs for s in scheduled):
            return None
        if not len(step.sampling_index):
            return SampledRows(step.logits_indices, {})   # no row samples: the KV-sharing layers do not run
        last_rows = [dataclasses.replace(scheduled[i], num_computed_tokens=scheduled[i].seq_len - 1, num_tokens=1,
                                         frames=[], block_updates={}) for i in step.sampling_index]
        # (their ids feed nothing: the KV-sharing layers take the step's hidden rows)
        small = self.inputs.build(last_rows, block_tables, rows[step.sampling_index], prev=prev)
        return SampledRows(step.logits_indices, {t: b.build(small.common[t]) for t, b in self.builders.items()})
