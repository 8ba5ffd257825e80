"""Adaptive switch-off: speculate only where it pays, judged from step times measured at
startup. With B requests decoding, tokens per request and second:

    plain         1 / T(B)                       T: a decode step
    speculating   E(a, k) / S(B, k)              S: propose + verify (k + 1 tokens per row)
                  E(a, k) = (1 - a^(k+1)) / (1 - a)   tokens a row gains per step

The scheduler asks `choose(B)` each step for the k to use (0: plain decode) and feeds each
verified row back to `observe`, which keeps the acceptance rate a up to date.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


def expected_tokens(acceptance_rate: float, k: int) -> float:
    """Tokens a speculating row gains per step when each draft is accepted with probability
    a, independently: the accepted run plus the correction or bonus token."""
    a = acceptance_rate
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class StepTimes:
    """Seconds per step, one entry per batch size (ascending, up to max_num_seqs); linear
    interpolation in between."""
    batch_sizes: tuple[int, ...]
    plain: tuple[float, ...]  # T(B)
    speculative: dict[int, tuple[float, ...]]  # k -> S(B, k): propose k, verify k + 1

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or any(b <= a for a, b in zip(sizes, sizes[1:])) or sizes[0] < 1:
            raise ValueError(f"batch_sizes must ascend from >= 1, got {sizes}")
        for name, series in [("plain", self.plain)] + [
                (f"speculative[{k}]", s) for k, s in self.speculative.items()]:
            if len(series) != len(sizes) or min(series) <= 0:
                raise ValueError(f"{name} needs {len(sizes)} positive times, got {series}")
        if not self.speculative or min(self.speculative) < 1:
            raise ValueError(f"speculative needs draft lengths k >= 1, got "
                             f"{sorted(self.speculative)}")

    def at(self, series: tuple[float, ...], batch_size: int) -> float:
        """The series at batch_size, interpolated; constant outside the measured range."""
        sizes = self.batch_sizes
        i = bisect_left(sizes, batch_size)
        if i == 0 or i == len(sizes):
            return series[min(i, len(sizes) - 1)]
        lo, hi = sizes[i - 1], sizes[i]
        weight = (batch_size - lo) / (hi - lo)
        return series[i - 1] + weight * (series[i] - series[i - 1])


def verdict(times: StepTimes, hysteresis: float = 0.05) -> str:
    """One line for the startup log: at each measured batch size, the lowest acceptance rate
    at which speculating beats plain decoding by the switch's margin."""
    grid = [i / 20 for i in range(21)]

    def threshold(batch: int) -> float | None:
        plain = 1.0 / times.at(times.plain, batch)
        return next((a for a in grid if max(expected_tokens(a, k) / times.at(s, batch)
                                            for k, s in times.speculative.items())
                     > plain * (1 + hysteresis)), None)

    parts = []
    for batch in times.batch_sizes:
        a = threshold(batch)
        parts.append(f"batch {batch}: " + ("never" if a is None else f"acceptance >= {a:.2f}"))
    return "speculation pays at " + "; ".join(parts)


class AcceptanceEstimate:
    """a = accepted / judged over verified rows (n of d accepted: n + (n < d) judged), both
    sums decaying per row so a change of workload shows within a few hundred rows; starts
    at a light prior worth `prior_weight` judged drafts."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 4.0,
                 decay: float = 0.995) -> None:
        self.accepted, self.judged, self.decay = prior * prior_weight, prior_weight, decay

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        judged = num_accepted + (num_accepted < num_drafts)
        self.accepted = self.accepted * self.decay + num_accepted
        self.judged = self.judged * self.decay + judged

    @property
    def rate(self) -> float:
        return self.accepted / self.judged


class SpeculationSwitch:
    """Chooses each step's k from StepTimes and the acceptance estimate, with hysteresis.
    While off, every `probe_every` steps one step drafts the shortest k that could win, so
    the estimate does not freeze."""

    def __init__(self, times: StepTimes, hysteresis: float = 0.05,
                 acceptance: AcceptanceEstimate | None = None, probe_every: int = 128) -> None:
        self.times = times
        self.hysteresis = hysteresis  # a switch needs a margin this large: no flapping
        self.acceptance = acceptance or AcceptanceEstimate()
        self.probe_every = probe_every
        self.k = 0
        self._steps_off = 0

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.acceptance.observe(num_drafts, num_accepted)

    def choose(self, batch_size: int) -> int:
        """The draft length for a step of batch_size decoding requests (0: do not
        speculate): the k with the best rate, if it beats plain decoding."""
        a, times = self.acceptance.rate, self.times
        best_rate, best_k = max((expected_tokens(a, k) / times.at(series, batch_size), k)
                                for k, series in times.speculative.items())
        plain_rate = 1.0 / times.at(times.plain, batch_size)
        # on: stay on unless plain wins by the margin; off: switch on only when it wins by it
        margin = 1.0 / (1.0 + self.hysteresis) if self.k else 1.0 + self.hysteresis
        self.k = best_k if best_rate > plain_rate * margin else 0
        self._steps_off = 0 if self.k else self._steps_off + 1
        if self._steps_off and self._steps_off % self.probe_every == 0:
            return self._probe_k(batch_size, plain_rate)
        return self.k

    def _probe_k(self, batch_size: int, plain_rate: float) -> int:
        """The shortest k that would win if every draft were accepted; 0 if none would."""
        times = self.times
        return min((k for k, series in times.speculative.items()
                    if expected_tokens(1.0, k) / times.at(series, batch_size) > plain_rate),
                   default=0)
