"""Prompt logprobs: at each prompt position that a step's PromptLogprobsJobs name, the
log-softmax of the logits, read at the prompt token that follows (its logprob and rank) and
at the top-k.

    hidden [T, n_embd] ─▶ rows of the jobs [P, n_embd] ─▶ slices of SLICE_ROWS rows:
        lm_head ─▶ float32 log_softmax [<= SLICE_ROWS, vocab] ─▶ target logprob, rank, top-k
    ─▶ [P], [P], [P, k], [P, k] on the device ─▶ host, one PromptLogprobs per job

Only one slice's logits exist at a time: its log-probs in float32, written over in place,
beside its logits in the model's dtype only while log_softmax reads them (at most two slices
of float32 at the peak), so a long prompt never holds [P, vocab] in float32. Results are
written straight into the output's rows; jobs whose rows make one run (a single job, say)
read `hidden` through views rather than a gather.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.batch import PromptLogprobs, PromptLogprobsJob, ScheduledSequence
from engine.worker.inputs import upload

SLICE_ROWS = 512  # positions whose logits exist at once: [512, 50257] float32 is 103 MB


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
                            seqs: list[ScheduledSequence],
                            query_start_loc: np.ndarray) -> PromptLogprobsOutput:
    """The PromptLogprobsJobs of `seqs` over a step's final hidden states (sequence i owns
    rows query_start_loc[i]:query_start_loc[i + 1] of `hidden`); at least one has a job.
    `lm_head` returns the logits of the rows it is given."""
    jobs = [(s.prompt_logprobs, s, int(query_start_loc[i])) for i, s in enumerate(seqs)
            if s.prompt_logprobs is not None]
    counts = [len(job.target_ids) for job, _, _ in jobs]
    out = _allocate(jobs, counts, hidden.device)
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
    for start in range(0, len(targets), SLICE_ROWS):
        part = slice(start, start + SLICE_ROWS)
        logprobs = torch.log_softmax(lm_head(rows_of(part)), dim=-1, dtype=torch.float32)
        _fill_slice(out, part, logprobs, targets[part])
    return out


def _allocate(jobs: list[tuple[PromptLogprobsJob, ScheduledSequence, int]], counts: list[int],
              device: torch.device) -> PromptLogprobsOutput:
    """The output of these jobs, its result tensors not yet written."""
    num_rows, width = sum(counts), max(job.num_top for job, _, _ in jobs)
    return PromptLogprobsOutput(
        request_ids=[s.request_id for _, s, _ in jobs],
        first_indices=[s.start_position + job.first_row + 1 for job, s, _ in jobs],
        num_top=[job.num_top for job, _, _ in jobs],
        offsets=np.concatenate([[0], np.cumsum(counts)]).tolist(),
        token_logprobs=torch.empty(num_rows, dtype=torch.float32, device=device),
        ranks=torch.empty(num_rows, dtype=torch.int64, device=device),
        top_ids=torch.empty(num_rows, width, dtype=torch.int64, device=device),
        top_logprobs=torch.empty(num_rows, width, dtype=torch.float32, device=device))


def _fill_slice(out: PromptLogprobsOutput, part: slice, logprobs: torch.Tensor,
                targets: torch.Tensor) -> None:
    """Write one slice's target logprobs, ranks (vLLM's: how many tokens have a logprob >=
    the target's) and top-k into `out`'s rows `part` (the logprob and top-k written there
    directly). `logprobs` (float32, fresh) are overwritten in place by the rank's
    comparison, so no other temporary is ever the slice's size."""
    token = out.token_logprobs[part][:, None]  # a view of the output's rows: [rows, 1]
    torch.gather(logprobs, 1, targets[:, None], out=token)
    if out.top_ids.shape[1]:
        torch.topk(logprobs, out.top_ids.shape[1], dim=-1,
                   out=(out.top_logprobs[part], out.top_ids[part]))
    out.ranks[part] = logprobs.ge_(token).sum(dim=-1)  # 1.0 where >=: an exact float count
