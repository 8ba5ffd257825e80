"""Prompt logprobs: at each prompt position that a step's PromptLogprobsJobs name, the
log-softmax of the logits, read at the prompt token that follows (its logprob and rank) and
at the top-k, by `Ops.prompt_logprobs` (one kernel on the GPU: kernels/logprobs.py).

    hidden [T, n_embd] ─▶ rows of the jobs [P, n_embd] ─▶ slices of SLICE_ROWS rows:
        lm_head ─▶ logits [<= SLICE_ROWS, vocab] ─▶ Ops.prompt_logprobs: target logprob,
        rank, top-k ─▶ [P], [P], [P, k], [P, k] on the device ─▶ host, one PromptLogprobs a job

Only one slice's logits exist at a time, in the model's dtype (the kernel reads them once and
writes no [rows, vocab] log-softmax), so a long prompt never holds [P, vocab]. Jobs whose rows
make one run (a single job, say) read `hidden` through views rather than a gather.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.batch import PromptLogprobs, ScheduledSequence
from engine.worker.inputs import upload

SLICE_ROWS = 512  # positions whose logits exist at once: [512, 50257] in 16 bits is 51 MB


@dataclass
class PromptLogprobsOutput:
    """One step's prompt logprobs, on the device until `to_host`. Rows are the jobs' positions
    in the step's order; job j owns rows offsets[j]:offsets[j + 1]."""
    request_ids: list[str]
    first_indices: list[int]  # per job: the prompt index of its first target token
    num_top: list[int]  # per job: how many of the top_k columns it asked for
    offsets: list[int]
    token_logprobs: torch.Tensor  # float32 [P]
    ranks: torch.Tensor  # int64 [P]
    top_ids: torch.Tensor  # int64 [P, max num_top]
    top_logprobs: torch.Tensor  # float32 [P, max num_top]
    host: list[torch.Tensor] | None = field(default=None, repr=False)
    ready: torch.cuda.Event | None = field(default=None, repr=False)

    def begin_host_copy(self) -> None:
        """Start copying the results to the host without waiting (once)."""
        if self.host is not None:
            return
        tensors = [self.token_logprobs, self.ranks, self.top_ids, self.top_logprobs]
        if not self.token_logprobs.is_cuda:
            self.host = tensors
            return
        self.host = [t.to("cpu", non_blocking=True) for t in tensors]
        self.ready = torch.cuda.Event()
        self.ready.record()

    def to_host(self) -> dict[str, PromptLogprobs]:
        """Wait for the copies; each job's results by request id."""
        self.begin_host_copy()
        if self.ready is not None:
            self.ready.synchronize()
        token_lps, ranks, top_ids, top_lps = (t.numpy() for t in self.host)
        results = {}
        for j, request_id in enumerate(self.request_ids):
            rows, k = slice(self.offsets[j], self.offsets[j + 1]), self.num_top[j]
            results[request_id] = PromptLogprobs(
                self.first_indices[j], token_lps[rows].tolist(), ranks[rows].tolist(),
                top_ids[rows, :k].tolist(), top_lps[rows, :k].tolist())
        return results


def compute_prompt_logprobs(hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
                            logprobs_op: Callable, seqs: list[ScheduledSequence],
                            query_start_loc: np.ndarray) -> PromptLogprobsOutput:
    """The PromptLogprobsJobs of `seqs` over a step's final hidden states (sequence i owns
    rows query_start_loc[i]:query_start_loc[i + 1] of `hidden`); at least one has a job.
    `lm_head` returns the logits of the rows it is given; `logprobs_op` is
    `Ops.prompt_logprobs`."""
    jobs = [(s.prompt_logprobs, s, int(query_start_loc[i])) for i, s in enumerate(seqs)
            if s.prompt_logprobs is not None]
    counts = [len(job.target_ids) for job, _, _ in jobs]
    starts = [first + job.first_row for job, _, first in jobs]  # each job's first row
    targets = np.concatenate([job.target_ids for job, _, _ in jobs])
    if all(start + count == after for start, count, after in zip(starts, counts, starts[1:])):
        run = hidden[starts[0]:starts[0] + len(targets)]
        rows_of = run.__getitem__  # one run of rows: slices of it are views
        targets = upload(targets, torch.int64, hidden.device)
    else:
        row_ids = np.concatenate([start + np.arange(count)
                                  for start, count in zip(starts, counts)])
        row_ids, targets = upload(np.stack([row_ids, targets]), torch.int64, hidden.device)
        def rows_of(part: slice) -> torch.Tensor:  # gathered a slice at a time
            return hidden[row_ids[part]]
    width = max(job.num_top for job, _, _ in jobs)
    slices = [logprobs_op(lm_head(rows_of(part)), targets[part], width)
              for part in (slice(start, start + SLICE_ROWS)
                           for start in range(0, len(targets), SLICE_ROWS))]
    token_logprobs, ranks, top_logprobs, top_ids = (
        columns[0] if len(slices) == 1 else torch.cat(columns) for columns in zip(*slices))
    return PromptLogprobsOutput(
        request_ids=[s.request_id for _, s, _ in jobs],
        first_indices=[s.start_position + job.first_row + 1 for job, s, _ in jobs],
        num_top=[job.num_top for job, _, _ in jobs],
        offsets=np.concatenate([[0], np.cumsum(counts)]).tolist(),
        token_logprobs=token_logprobs, ranks=ranks, top_ids=top_ids, top_logprobs=top_logprobs)
