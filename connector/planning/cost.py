"""Load or recompute: the connector's cost model per request, pure (no I/O, no clock of its own, no vLLM).

    predicted load      = lookup round trip + bytes / measured load bandwidth
    predicted recompute = tokens / the engine's prefill rate

The bandwidth is what this node's loads delivered: bytes that arrived over the seconds they took, gather-to-scatter,
so the copies into the KV cache are in it. A load that ran out of its deadline counts the bytes that did arrive over
the whole deadline, so a slow or stalled gateway pulls the estimate down at once. The prefill rate is learnt from
the engine's steps (tokens scheduled over the time to the next step), or starts from a setting. Every estimate is
an EWMA; the bandwidth drifts back to its prior with a half-life while no load measures it, so one bad spell does not
switch loads off for good (the next load measures again, and costs at most its deadline).

``plan`` loads the longest prefix of the hit that pays (predicted load below predicted recompute) and fits the
longest load a request may wait for (``max_deadline_s``): all of it, part of it, or none. Its deadline is the
prediction times ``deadline_factor`` (at least ``min_deadline_s``, at most ``max_deadline_s``); past it, the load
stops and vLLM recomputes the blocks that did not arrive.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

MIB = 1024 * 1024
FLOOR = 1 << 16
"""The estimate never falls below the prior / FLOOR: a stall must not switch loads off for longer than a few
half-lives."""


class Verdict(enum.StrEnum):
    LOAD = "load"
    """The whole hit is loaded."""
    PARTIAL = "partial"
    """A prefix of the hit is loaded: the rest does not fit the longest wait."""
    SKIP = "skip"
    """Nothing is loaded: recomputing is predicted faster."""
    PROBE = "probe"
    """Recomputing is predicted faster, but no load has measured the link for a half-life: the hit is loaded with
    the shortest deadline, to measure it (a slow link costs the request at most that deadline)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostSettings:
    bandwidth_prior_bytes_s: float = 1000.0 * MIB
    """The load bandwidth assumed before any load measured it (and drifted back to while none does)."""
    bandwidth_half_life_s: float = 30.0
    """How fast an estimate nothing has measured for a while drifts back to the prior (halfway, in log terms, per
    half-life)."""
    prefill_tokens_s: float = 0.0
    """The engine's prefill rate to start from; 0: unknown until the engine's steps measured it (loads then face
    the longest wait only)."""
    lookup_rtt_prior_s: float = 0.002
    alpha: float = 0.3
    """Weight of a new sample in the EWMAs."""
    deadline_factor: float = 2.0
    min_deadline_s: float = 0.5
    max_deadline_s: float = 5.0
    min_step_tokens: int = 256
    always_load: bool = False
    """Every hit is loaded whole with the longest deadline (``max_deadline_s``), whatever the estimates say: for
    correctness runs that must see every hit loaded, and A/B runs against the model."""
    """A step with fewer tokens than this (decodes) says nothing about the prefill rate."""


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    """What one load measured (on one worker rank, or merged over the ranks)."""

    loaded: int
    """Leading blocks loaded into the KV cache."""
    nbytes: int
    """Bytes of every GET that completed (scattered or not)."""
    seconds: float
    expired: bool
    """The load ran out of its deadline before every block was loaded."""
    prefetched: int = 0
    """Bytes taken from blocks fetched at the request's arrival (connector/worker/prefetch.py): they crossed the link
    before the load was timed, so a load with any is no measure of the link (``measures_link``)."""

    @property
    def measures_link(self) -> bool:
        """Its bytes over its seconds are the link's bandwidth: every block it loaded was read while it was timed."""
        return self.prefetched == 0

    def merge(self, other: LoadOutcome) -> LoadOutcome:
        """The same request's load on another rank: the ranks read at once, so bytes add and the slowest counts."""
        return LoadOutcome(
            loaded=min(self.loaded, other.loaded),
            nbytes=self.nbytes + other.nbytes,
            seconds=max(self.seconds, other.seconds),
            expired=self.expired or other.expired,
            prefetched=self.prefetched + other.prefetched,
        )


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    blocks: int
    """Leading blocks of the hit to load."""
    hit_blocks: int
    predicted_load_s: float
    """Of the blocks loaded (0 when none are)."""
    predicted_recompute_s: float
    """Of the whole hit (inf while the prefill rate is unknown)."""
    deadline_s: float
    reason: str


class Ewma:
    def __init__(self, *, prior: float, alpha: float) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha {alpha} is not in (0, 1]")
        self.value = prior
        self.alpha = alpha
        self.samples = 0

    def observe(self, sample: float) -> None:
        self.value = sample if self.samples == 0 else self.value + self.alpha * (sample - self.value)
        self.samples += 1


class CostModel:
    """The estimates and the decision. Callers pass ``now`` (monotonic seconds) where time matters."""

    def __init__(self, settings: CostSettings) -> None:
        self.settings = s = settings
        self._bandwidth = Ewma(prior=s.bandwidth_prior_bytes_s, alpha=s.alpha)
        self._bandwidth_at: float | None = None
        self.prefill = Ewma(prior=s.prefill_tokens_s, alpha=s.alpha)
        self.lookup_rtt = Ewma(prior=s.lookup_rtt_prior_s, alpha=s.alpha)

    # -- what was measured -------------------------------------------------------------------------------------

    def observe_load(self, *, nbytes: int, seconds: float, now: float) -> None:
        """A load (or the part of it that arrived before its deadline) moved ``nbytes`` in ``seconds``."""
        if seconds <= 0:
            return
        self._bandwidth.value = self.bandwidth(now=now)  # the drift so far is kept, then the sample weighs in
        self._bandwidth.observe(nbytes / seconds)
        self._bandwidth_at = now

    def observe_step(self, *, tokens: int, seconds: float) -> None:
        """An engine step ran ``tokens`` in ``seconds``; only steps with prefill-sized work are counted."""
        if tokens >= self.settings.min_step_tokens and seconds > 0:
            self.prefill.observe(tokens / seconds)

    def observe_lookup(self, *, seconds: float) -> None:
        self.lookup_rtt.observe(seconds)

    def bandwidth(self, *, now: float) -> float:
        """Bytes/s expected of the next load: the estimate, drifted toward the prior by its age (geometrically: the
        prior and a slow link's estimate may be thousands of times apart). Never below the prior / FLOOR."""
        prior = self.settings.bandwidth_prior_bytes_s
        est = max(self._bandwidth.value, prior / FLOOR)
        if self._bandwidth_at is None or self.settings.bandwidth_half_life_s <= 0:
            return est
        age = max(0.0, now - self._bandwidth_at)
        kept = math.pow(0.5, age / self.settings.bandwidth_half_life_s)
        return math.exp(math.log(prior) + (math.log(est) - math.log(prior)) * kept)

    def _stale(self, now: float) -> bool:
        """No load has measured the link yet, or none for a half-life: its estimate is (nearly) the prior's."""
        return self._bandwidth_at is None or now - self._bandwidth_at >= self.settings.bandwidth_half_life_s

    # -- the decision ------------------------------------------------------------------------------------------

    def predict_load_s(self, *, nbytes: int, now: float) -> float:
        bw = self.bandwidth(now=now)
        return self.lookup_rtt.value + (nbytes / bw if bw > 0 else math.inf)

    def predict_recompute_s(self, *, tokens: int) -> float:
        rate = self.prefill.value
        return tokens / rate if rate > 0 else math.inf

    def deadline_s(self, predicted_load_s: float) -> float:
        s = self.settings
        return min(s.max_deadline_s, max(s.min_deadline_s, predicted_load_s * s.deadline_factor))

    def plan(self, *, hit_blocks: int, block_tokens: int, block_bytes: int, now: float) -> Decision:
        """How many of ``hit_blocks`` leading blocks (of ``block_tokens`` tokens, ``block_bytes`` bytes) to load."""
        recompute = self.predict_recompute_s(tokens=hit_blocks * block_tokens)
        if hit_blocks <= 0:
            return Decision(Verdict.SKIP, 0, 0, 0.0, recompute, 0.0, "no hit")
        bw = self.bandwidth(now=now)
        rtt = self.lookup_rtt.value
        per_block_load = block_bytes / bw if bw > 0 else math.inf
        if self.settings.always_load:
            load = rtt + hit_blocks * per_block_load
            return Decision(
                Verdict.LOAD, hit_blocks, hit_blocks, load, recompute, self.settings.max_deadline_s, "always_load"
            )
        per_block_recompute = block_tokens / self.prefill.value if self.prefill.value > 0 else math.inf
        if per_block_load >= per_block_recompute and self._stale(now):
            return Decision(
                Verdict.PROBE,
                hit_blocks,
                hit_blocks,
                rtt + hit_blocks * per_block_load,
                recompute,
                self.settings.min_deadline_s,
                f"no load measured the link for {self.settings.bandwidth_half_life_s:.0f}s: a probe",
            )
        if per_block_load >= per_block_recompute:
            return Decision(
                Verdict.SKIP,
                0,
                hit_blocks,
                0.0,
                recompute,
                0.0,
                f"a block loads in {per_block_load:.4f}s, "
                f"recomputes in {per_block_recompute:.4f}s ({bw / MIB:.1f} MiB/s)",
            )
        # the longest prefix that fits the longest wait; loading n blocks pays once n exceeds the break-even
        fits = math.floor((self.settings.max_deadline_s - rtt) / per_block_load) if per_block_load > 0 else hit_blocks
        n = max(0, min(hit_blocks, fits))
        gain = per_block_recompute - per_block_load
        if n == 0 or (math.isfinite(per_block_recompute) and n * gain <= rtt):
            return Decision(
                Verdict.SKIP,
                0,
                hit_blocks,
                0.0,
                recompute,
                0.0,
                f"{n} blocks fit {self.settings.max_deadline_s:.2f}s and gain less than the round trip {rtt:.4f}s",
            )
        load = rtt + n * per_block_load
        verdict = Verdict.LOAD if n == hit_blocks else Verdict.PARTIAL
        reason = (
            f"load {load:.3f}s < recompute {recompute:.3f}s ({bw / MIB:.1f} MiB/s)"
            if verdict is Verdict.LOAD
            else f"{n} of {hit_blocks} blocks fit the longest wait {self.settings.max_deadline_s:.2f}s "
            f"({bw / MIB:.1f} MiB/s)"
        )
        return Decision(verdict, n, hit_blocks, load, recompute, self.deadline_s(load), reason)
