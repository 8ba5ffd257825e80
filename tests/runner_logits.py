"""The logits a runner's model computes at each sampling sequence's last token, through the
same inputs and paged KV cache a step uses, for comparisons with transformers."""
from __future__ import annotations

import torch

from engine.core.batch import SchedulerOutput
from engine.worker.inputs import prepare_host_inputs, to_device


@torch.inference_mode()
def logits_at_samples(runner, out: SchedulerOutput) -> torch.Tensor:
    """float32 [sampling sequences, vocab]; writes the step's KV as a step would."""
    host = prepare_host_inputs(out.sequences, runner.block_size, runner.max_blocks_per_seq)
    step = to_device(host, runner.device)
    hidden = runner.model(step.input_ids, step.positions, runner.kv_caches, step.meta)
    return runner.model.lm_head(hidden[step.sample_indices]).float()
