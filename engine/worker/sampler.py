"""Batched sampling on the logits' device. One row of logits per sequence with sample=True.

    plain rows (temperature only):  draw(logits, T, seed)                one launch on CUDA
      and some with a grammar mask:  then masked_draw(their rows, bitmask) in place: one more
      and some asking for logprobs:  then log_softmax(their raw logits): gather, top-k
    other batches:  sanitise (NaN, inf) ─▶ raw logprobs (requests asking for them)
      ─▶ grammar mask (structured outputs) ─▶ allowed_token_ids ─▶ bad words ─▶ logit_bias ─▶ min_tokens (mask stop tokens)
      ─▶ penalties
      ─▶ / temperature ─▶ top-k ─▶ top-p ─▶ min-p ─▶ draw(filtered, T > 0 ? 1 : 0, seed)

The draw is a Gumbel-max race (`engine.worker.layers.sample`, `kernels.sampling` on CUDA): the
argmax of logits / T plus Gumbel noise hashed from the row's seed and the token id, or the
plain argmax for greedy rows. A seeded request's seed for a token is (seed, tokens generated
so far), so its tokens depend neither on its batch nor on preemption, nor on which path drew
them; unseeded rows take fresh seeds from the sampler's generator. When every row of a step
that ran as a CUDA graph is plain, the sampler takes the graph's own draw and launches nothing.
Per-row parameters reach the device through pinned memory (`engine.worker.inputs.upload`), so
sampling never waits for the step still running before it.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.worker import layers
from engine.core.batch import GrammarMask, ScheduledSequence, TokenLogprobs
from engine.worker.inputs import upload
from engine.core.request import EOS_TOKEN_ID

NEG_INF = float("-inf")
NO_TOKEN = -1  # pads verified_token_ids after a row's sampled token


@dataclass
class SamplerOutput:
    """Device tensors for one step; `to_lists` brings them to the host with one sync."""
    token_ids: torch.Tensor  # [N] int64
    logprob_rows: list[int]  # rows whose request asked for logprobs
    num_top: list[int]  # per logprob row: how many alternatives it asked for
    sampled_logprobs: torch.Tensor | None = None  # [len(logprob_rows)]
    top_ids: torch.Tensor | None = None  # [len(logprob_rows), >= max(num_top)]: row j's first
    top_logprobs: torch.Tensor | None = None  # num_top[j] (LogprobGraphs' may be wider)
    # a step with drafts (engine/worker/speculation.py): [N, k + 1] int64, each row's
    # accepted drafts, then its sampled token, then NO_TOKEN
    verified_token_ids: torch.Tensor | None = None
    host: list[torch.Tensor] | None = field(default=None, repr=False)  # once copies started
    ready: torch.cuda.Event | None = field(default=None, repr=False)  # when they landed

    def begin_host_copy(self) -> None:
        """Start every device-to-host copy (into pinned memory) and mark when they land,
        without waiting: the host can do other work while the step finishes. Once only:
        a second call does nothing."""
        if self.host is not None:
            return
        tensors = [self.token_ids]
        if self.logprob_rows:
            tensors += [self.sampled_logprobs, self.top_ids, self.top_logprobs]
        if self.verified_token_ids is not None:
            tensors.append(self.verified_token_ids)
        if not tensors[0].is_cuda:
            self.host = [t.clone() for t in tensors]  # a snapshot, as the copy would be
            return
        self.host = [t.to("cpu", non_blocking=True) for t in tensors]
        self.ready = torch.cuda.Event()
        self.ready.record()

    def to_lists(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Wait for the copies (one sync per step) and convert to Python lists."""
        if self.host is None:
            self.begin_host_copy()
        if self.ready is not None:
            self.ready.synchronize()
        token_ids = self.host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprob_rows:
            sampled, top_ids, top_lps = (t.tolist() for t in self.host[1:4])
            for j, (row, k) in enumerate(zip(self.logprob_rows, self.num_top)):
                logprobs[row] = TokenLogprobs(sampled[j], top_ids[j][:k], top_lps[j][:k])
        return token_ids, logprobs

    def accepted_drafts(self) -> list[list[int]]:
        """Each row's accepted drafts, once to_lists has waited; [] for a step without."""
        if self.verified_token_ids is None:
            return []
        return [row[:row.index(NO_TOKEN) - 1] if NO_TOKEN in row else row[:-1]
                for row in self.host[-1].tolist()]


def _seed_rows(seeds: np.ndarray, seqs: list[ScheduledSequence], rows: list[int]) -> None:
    """Seeded rows draw at their request's seed for the token they sample (step_seed)."""
    for row in rows:
        s = seqs[row]
        seeds[row] = step_seed(s.params.seed, s.num_output_tokens)


def is_plain_draw(seqs: list[ScheduledSequence]) -> bool:
    """Every row's token is drawn from its raw logits at its temperature (greedy: their
    argmax), with nothing else applied: what the decode graphs and `draw` alone compute."""
    return all(s.params.draws_from_raw_logits and s.num_output_tokens >= s.params.min_tokens
               and s.params.structured_outputs is None for s in seqs)


def is_plain_but_logprobs(seqs: list[ScheduledSequence]) -> bool:
    """Every row's token is a plain draw (is_plain_draw), some rows asking for logprobs too."""
    return all(s.params.draws_at_temperature_only and s.num_output_tokens >= s.params.min_tokens
               and s.params.structured_outputs is None for s in seqs)


def is_plain_but_masked(seqs: list[ScheduledSequence]) -> bool:
    """Every row is a plain draw but for its grammar mask, if it has one."""
    return all(s.params.draws_from_raw_logits and s.num_output_tokens >= s.params.min_tokens
               for s in seqs)


# (temperature per row, 0 for greedy: float32 [N]; noise seed per row: int64 [N])
DrawInputs = tuple[np.ndarray, np.ndarray]


class Sampler:
    """Turns a step's logits into next tokens. `draw` is the device's Gumbel-max op
    (`Ops.sample`), `masked_draw` the same over grammar bitmasks, in place
    (`Ops.masked_sample`), `logprobs` the rows' token logprob and top k (`Ops.token_logprobs`);
    the only state is the generator that seeds unseeded rows (seeded once, so a whole engine
    run is reproducible). `masked_graphs` and `logprob_graphs`, once the runner has captured
    them, replay the masked draw after a graph's draws and the logprobs."""

    def __init__(self, seed: int = 0, draw=layers.sample, masked_draw=layers.masked_sample,
                 logprobs=layers.token_logprobs):
        self.rng = np.random.default_rng(seed)
        self.draw = draw
        self.masked_draw = masked_draw
        self.logprobs = logprobs
        self.masked_graphs = None  # cuda_graphs.MaskedDrawGraphs
        self.logprob_graphs = None  # cuda_graphs.LogprobGraphs

    def draw_inputs(self, seqs: list[ScheduledSequence]) -> DrawInputs:
        """Host arrays for this step's draw; every step takes fresh seeds for its rows."""
        temperature = np.array([s.params.temperature for s in seqs], dtype=np.float32)
        seeds = self._fresh_seeds(len(seqs))
        _seed_rows(seeds, seqs, [row for row, s in enumerate(seqs) if s.params.seed is not None])
        return temperature, seeds

    def _fresh_seeds(self, rows: int) -> np.ndarray:
        """Raw 64-bit draws halved to 63 bits: 5x cheaper than rng.integers at batch 256."""
        return (self.rng.bit_generator.random_raw(rows) >> np.uint64(1)).astype(np.int64)

    def continued_draw_inputs(self, temperature: np.ndarray, seeded: np.ndarray,
                              seeds: np.ndarray, num_outputs: np.ndarray) -> DrawInputs:
        """draw_inputs(rows) from the rows' columns, not the rows: each row's `temperature`,
        whether it is `seeded`, its request's seed and the output position it samples (read
        for the seeded rows only)."""
        step_seeds = self._fresh_seeds(len(temperature))
        for row in np.flatnonzero(seeded).tolist():
            step_seeds[row] = step_seed(seeds[row], int(num_outputs[row]))
        return temperature, step_seeds

    def __call__(self, logits: torch.Tensor, seqs: list[ScheduledSequence],
                 draw_inputs: DrawInputs | None = None, drawn: torch.Tensor | None = None,
                 mask: GrammarMask | None = None) -> SamplerOutput:
        """Next tokens from `logits` (the model's dtype, as the model returns them; filters
        work on a float32 copy). `drawn`: each row's draw already made on the device at these
        draw inputs (a CUDA graph's), which is the answer when every row is a plain draw.
        `mask`: the grammar mask of the rows with structured outputs (required if any)."""
        temperature, seeds = draw_inputs or self.draw_inputs(seqs)
        if is_plain_draw(seqs):
            if drawn is None:
                drawn = self.draw(logits, upload(temperature, torch.float32, logits.device),
                                  upload(seeds, torch.int64, logits.device))
            return SamplerOutput(drawn, [], [])
        if is_plain_but_masked(seqs):
            rows = np.array([i for i, s in enumerate(seqs)
                             if s.params.structured_outputs is not None], dtype=np.int64)
            return self.masked_draw_rows(logits, [s.request_id for s in seqs], rows,
                                         (temperature, seeds), drawn, mask)
        logprob_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        num_top = [seqs[i].params.logprobs for i in logprob_rows]
        if is_plain_but_logprobs(seqs) and drawn is not None:  # the graph's draw stands
            return self._with_logprobs(SamplerOutput(drawn, logprob_rows, num_top), logits)
        logits = sanitize(logits.float())
        if is_plain_but_logprobs(seqs):  # drawn here from the sanitised logits: NaN never wins
            drawn = self.draw(logits, upload(temperature, torch.float32, logits.device),
                              upload(seeds, torch.int64, logits.device))
            return self._with_logprobs(SamplerOutput(drawn, logprob_rows, num_top), logits)
        seeds = upload(seeds, torch.int64, logits.device)
        raw_rows = _copy_rows(logits, logprob_rows) if logprob_rows else None
        logits = apply_grammar_mask(logits, seqs, mask)
        logits = apply_allowed_token_ids(logits, seqs)
        logits = apply_bad_words(logits, seqs)
        logits = apply_logit_bias(logits, seqs)
        logits = apply_min_tokens(logits, seqs)
        logits = apply_penalties(logits, seqs)
        # _filter divides by the temperature: the draw scales by 1, or takes the argmax
        scale = upload((temperature > 0).astype(np.float32), torch.float32, logits.device)
        out = SamplerOutput(self.draw(_filter(logits, seqs), scale, seeds), logprob_rows, num_top)
        return out if raw_rows is None else self._with_logprobs(out, raw_rows)

    def _with_logprobs(self, out: SamplerOutput, logits: torch.Tensor) -> SamplerOutput:
        """`out` with its logprob rows' sampled-token logprob and top alternatives, read from
        `logits`: the step's rows, or its logprob rows alone (copied before the filters)."""
        tokens, rows = out.token_ids, None
        if len(out.logprob_rows) < len(tokens):
            picked = upload(out.logprob_rows, torch.int64, tokens.device)
            if logits.shape[0] == len(tokens):
                rows = picked
            else:
                tokens = tokens[picked]
        op, graphs = self.logprobs, self.logprob_graphs
        if graphs is not None and graphs.takes(logits, len(out.logprob_rows)):
            op = graphs.run  # its top logprobs come wider than asked: to_lists cuts each row
        out.sampled_logprobs, out.top_logprobs, out.top_ids = op(logits, rows, tokens,
                                                                 max(out.num_top))
        return out

    def masked_draw_rows(self, logits: torch.Tensor, request_ids: list[str],
                         rows: np.ndarray, draw_inputs: DrawInputs, drawn: torch.Tensor | None,
                         mask: GrammarMask | None, staged: bool = False) -> SamplerOutput:
        """__call__ for rows (their `request_ids`) that are all plain draws but for the
        grammar masks of `rows` (int64, ascending: the constrained ones): plain draws for
        every row (the graph's, if it made them; none when every row is constrained), then
        one masked draw of `rows` over their bitmask, in place: replayed (MaskedDrawGraphs) where a graph wrote the
        step's StepOutputs, else three uploads (rows and seeds, temperatures, the bitmask)
        and one launch. `staged`: the replay's other inputs came in with the step's
        (MaskedDrawGraphs.stage): only the mask is copied."""
        temperature, seeds = draw_inputs
        device = logits.device
        graphs = self.masked_graphs
        if graphs is not None and drawn is not None and graphs.takes(logits, drawn, len(rows)):
            check_mask(request_ids, rows.tolist(), mask)
            if staged:
                graphs.run_staged(mask.bitmask)
            else:
                graphs.run(rows, mask.bitmask, temperature[rows], seeds[rows])
            return SamplerOutput(drawn, [], [])
        words = grammar_words(request_ids, rows.tolist(), mask, device)
        if drawn is None:
            drawn = (self.draw(logits, upload(temperature, torch.float32, device),
                               upload(seeds, torch.int64, device))
                     if len(rows) < len(request_ids)
                     else torch.empty(len(request_ids), dtype=torch.int64, device=device))
        rows_seeds = upload(np.stack([rows, seeds[rows]]), torch.int64, device)
        self.masked_draw(logits, rows_seeds[0], words,
                         upload(temperature[rows], torch.float32, device), rows_seeds[1], drawn)
        return SamplerOutput(drawn, [], [])


def _copy_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `rows` of the logits, kept from the filters (some write in place)."""
    if len(rows) < logits.shape[0]:
        return logits[upload(rows, torch.int64, logits.device)]  # a gather copies
    return logits.clone()


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf, +inf -> the largest float; a row with nothing finite left becomes uniform,
    so a broken row still yields a valid token instead of NaN probabilities."""
    logits = torch.nan_to_num(logits, nan=NEG_INF, posinf=torch.finfo(logits.dtype).max,
                              neginf=NEG_INF)
    dead = ~torch.isfinite(logits).any(dim=-1, keepdim=True)
    return logits.masked_fill(dead, 0.0)


def _rows_tokens(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    rows, tokens = zip(*pairs)
    return upload(rows, torch.long, device), upload(tokens, torch.long, device)


def grammar_words(request_ids: list[str], rows: list[int], mask: GrammarMask | None,
                  device: torch.device) -> torch.Tensor:
    """`mask`'s bitmask on `device`, once it is checked to hold the constrained `rows` of the
    step's rows (their `request_ids`), in order. Copied straight from its array, which may be
    page-locked and stays valid until the step's tokens are waited for (so no pinned staging
    copy); on the CPU, the array itself."""
    check_mask(request_ids, rows, mask)
    return torch.from_numpy(mask.bitmask).to(device, non_blocking=True)


def check_mask(request_ids: list[str], rows: list[int], mask: GrammarMask | None) -> None:
    if mask is None or mask.request_ids != [request_ids[i] for i in rows]:
        raise ValueError("the grammar mask does not match the step's constrained rows")


def apply_grammar_mask(logits: torch.Tensor, seqs: list[ScheduledSequence],
                       mask: GrammarMask | None) -> torch.Tensor:
    """Rows with structured outputs keep only the tokens their grammar allows (`mask`'s rows
    are those rows, in order); one upload and one masked fill for the step."""
    rows = [i for i, s in enumerate(seqs) if s.params.structured_outputs is not None]
    if not rows:
        return logits
    words = grammar_words([s.request_id for s in seqs], rows, mask, logits.device)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    banned = ((words[:, :, None] >> bits) & 1 == 0).flatten(1)[:, :logits.shape[-1]]
    if len(rows) == len(seqs):  # the masked draw's case: every row is constrained
        return logits.masked_fill_(banned, NEG_INF)
    rows_t = upload(rows, torch.long, logits.device)
    logits[rows_t] = logits[rows_t].masked_fill(banned, NEG_INF)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor,
                            seqs: list[ScheduledSequence]) -> torch.Tensor:
    """A row whose request names allowed_token_ids keeps only their logits; the others -inf.
    Rows without the field are untouched and cost the host one attribute check."""
    limited = [(i, s.params.allowed_token_ids) for i, s in enumerate(seqs)
               if s.params.allowed_token_ids is not None]
    if not limited:
        return logits
    device = logits.device
    rows = np.repeat([i for i, _ in limited], [len(allowed) for _, allowed in limited])
    tokens = np.concatenate([np.asarray(allowed, np.int64) for _, allowed in limited])
    inside = tokens < logits.shape[-1]
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[upload([i for i, _ in limited], torch.long, device)] = False
    allowed = (upload(rows[inside], torch.long, device), upload(tokens[inside], torch.long, device))
    keep[allowed] = True
    return logits.masked_fill(~keep, NEG_INF)


def apply_bad_words(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """vLLM's bad words: a word's last token is banned in a row whose output so far ends with
    the word's other tokens (a one-token word: always). Host work is per bad word of the rows
    that have them; the mask is one scatter on the device."""
    vocab = logits.shape[-1]
    banned = [(i, word[-1]) for i, s in enumerate(seqs) for word in s.params.bad_words_token_ids
              if word[-1] < vocab and _ends_with(s.output_token_ids, word[:-1])]
    if not banned:
        return logits
    return logits.index_put(_rows_tokens(banned, logits.device), logits.new_full((), NEG_INF))


def _ends_with(tokens: tuple[int, ...], prefix: tuple[int, ...]) -> bool:
    return not prefix or tuple(tokens[-len(prefix):]) == prefix


def apply_logit_bias(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    vocab = logits.shape[-1]
    entries = [(i, tok, bias) for i, s in enumerate(seqs) for tok, bias in s.params.logit_bias
               if tok < vocab]  # an id past the vocabulary can never be sampled anyway
    if not entries:
        return logits
    rows, tokens = _rows_tokens([(i, tok) for i, tok, _ in entries], logits.device)
    bias = upload([b for *_, b in entries], logits.dtype, logits.device)
    return logits.index_put((rows, tokens), bias, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Until a request has min_tokens outputs, its stop tokens (EOS unless ignore_eos) are
    banned, so it cannot end early."""
    vocab = logits.shape[-1]
    banned = []
    for i, s in enumerate(seqs):
        if s.num_output_tokens < s.params.min_tokens:
            stops = set(s.params.stop_token_ids)
            if not s.params.ignore_eos:
                stops.add(EOS_TOKEN_ID)
            banned += [(i, tok) for tok in sorted(stops) if tok < vocab]
    if not banned:
        return logits
    return logits.index_put(_rows_tokens(banned, logits.device), logits.new_full((), NEG_INF))


def _token_matrix(token_lists: list[tuple[int, ...]], pad: int, device) -> torch.Tensor:
    """Ragged token lists as one [N, longest] int64 tensor padded with `pad`."""
    matrix = np.full((len(token_lists), max(map(len, token_lists), default=0)), pad, np.int64)
    for row, tokens in enumerate(token_lists):
        matrix[row, :len(tokens)] = tokens
    return upload(matrix, torch.int64, device)


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Repetition penalty as HF (over prompt + output: positive logits divided, negative
    multiplied); presence and frequency penalties as OpenAI (over output tokens only)."""
    if not any(s.params.needs_penalties for s in seqs):
        return logits
    num_rows, vocab = logits.shape
    device = logits.device

    def per_row(name: str) -> torch.Tensor:
        return upload([getattr(s.params, name) for s in seqs], torch.float32, device)[:, None]

    # the extra column `vocab` collects padding and is dropped
    outputs = _token_matrix([s.output_token_ids if s.params.needs_penalties else ()
                             for s in seqs], vocab, device)
    counts = torch.zeros(num_rows, vocab + 1, device=device).scatter_add_(
        1, outputs, torch.ones_like(outputs, dtype=torch.float))[:, :vocab]
    seen = _token_matrix([s.prompt_token_ids + s.output_token_ids
                          if s.params.repetition_penalty != 1.0 else () for s in seqs],
                         vocab, device)
    in_context = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device).scatter_(
        1, seen, True)[:, :vocab]
    rep = per_row("repetition_penalty")
    logits = torch.where(in_context, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits - per_row("frequency_penalty") * counts
            - per_row("presence_penalty") * (counts > 0).float())


def _filter(logits: torch.Tensor, seqs: list[ScheduledSequence]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (each only when some row uses it)."""
    device, vocab = logits.device, logits.shape[-1]
    temps = upload([s.params.temperature or 1.0 for s in seqs], torch.float32, device)[:, None]
    # +inf became finfo.max, which / temperature < 1 overflows again: clamp back
    logits = (logits / temps).clamp(max=torch.finfo(logits.dtype).max)
    top_k = [s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs]
    # top_p 1 must keep everything, even where rounding lets the cumulative mass reach 1 early
    top_p = [s.params.top_p if s.params.top_p < 1.0 else float("inf") for s in seqs]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, upload(top_k, torch.int64, device),
                              upload(top_p, torch.float32, device))
    min_p = [s.params.min_p for s in seqs]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        floor = upload(min_p, torch.float32, device)[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, NEG_INF)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """One descending sort serves both masks. Top-p drops a token when the probability mass
    strictly before it already reaches p, so the most likely token always survives."""
    ordered, order = logits.sort(dim=-1, descending=True)
    kth = ordered.gather(1, (top_k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, NEG_INF)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(mass_before >= top_p[:, None], NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for one (request seed, output position) pair."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
