"""What drafting has really yielded: tokens per second of steps that draft, beside steps that do not.

No vLLM here. The prices (:mod:`.prices`) predict a plan's rate from cost curves and acceptance;
this module measures both kinds of step as they run and keeps the plan honest. Per batch band
(1, 2-3, 4-7, ...: a step's rate depends on its batch), two arms:

* **drafting**: a step that verified the drafts of the step before and drafted by a head plan
  again (the steady state of drafting); its tokens are its requests plus the drafts accepted;
* **plain**: a step that neither verified nor drafted (the steady state of plain decoding).

Each arm's rate is its tokens over its seconds (start to the next step's start, all of the engine's
work), averaged over its last ~``MEMORY`` steps. A head plan runs only while the band's drafting
rate is at least its plain rate; the other arm is measured by probes, ``PROBE_STEPS`` steps every
``PROBE_EVERY`` (the first step of a probe is a transition and teaches nothing). Until both arms
are measured the prices decide, and a band's plain arm is probed as soon as its drafting arm is
measured. Every decision is a function of the state and the step
counts, so ranks that share the state (:meth:`Outcomes.state`) decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["MEMORY", "PROBE_EVERY", "PROBE_STEPS", "Outcomes", "Verdict"]

#: Each arm's rate is a running mean over about this many of its steps (fewer at first).
MEMORY = 32
#: Steps a band runs one way before the other arm is probed, and steps a probe runs.
PROBE_EVERY = 48
PROBE_STEPS = 4
#: An arm's rate counts once this many of its steps were measured.
MIN_STEPS = 3
#: A step that took longer than this many times its arm's mean waited (no requests, a stall):
#: it is counted at this bound.
STALL = 4.0

DRAFTING, PLAIN = 0, 1


@dataclass(frozen=True)
class Verdict:
    """One step's outcome check for a head plan: ``draft`` (run it) and why (``reason``:
    "evidence", "no evidence", "probe" of the arm that evidence ruled out, "plain probe", "vetoed")."""

    draft: bool
    reason: str


class Outcomes:
    """Measured rates of drafting and plain steps per batch band, and the probes that keep them fresh.

    max_batch: the engine's most requests a step (bands up to its power of two).
    """

    def __init__(self, max_batch: int) -> None:
        bands = max(1, int(max_batch)).bit_length()
        self.tokens = np.zeros((bands, 2))  # running means per step, by band and arm
        self.seconds = np.zeros((bands, 2))
        self.steps = np.zeros((bands, 2))  # steps measured (the running means' weight)
        self.since_probe = np.zeros(bands)  # head-plan steps since the band's last probe
        self.probe_left = np.zeros(bands)  # steps left in the band's probe (0: none under way)
        self.probe_arm = np.zeros(bands)  # the arm the probe runs
        self.probes = 0
        self.vetoed = 0

    @staticmethod
    def band(batch: int) -> int:
        return max(1, int(batch)).bit_length() - 1

    def _row(self, batch: int) -> int:
        """The band of ``batch`` in this engine's tables (the last holds every larger batch)."""
        return min(self.band(batch), len(self.steps) - 1)

    def record(self, batch: int, drafting: bool, tokens: float, seconds: float) -> None:
        """A finished step of ``batch`` requests, of arm ``drafting`` (else plain), that yielded
        ``tokens`` in ``seconds``."""
        b = self._row(batch)
        arm = DRAFTING if drafting else PLAIN
        n = self.steps[b, arm]
        if n >= 1:
            seconds = min(seconds, STALL * self.seconds[b, arm])
        rate = max(1.0 / (n + 1.0), 1.0 / MEMORY)
        self.tokens[b, arm] += rate * (tokens - self.tokens[b, arm])
        self.seconds[b, arm] += rate * (seconds - self.seconds[b, arm])
        self.steps[b, arm] = n + 1

    def rate(self, batch: int, drafting: bool) -> float | None:
        """The band's measured tokens per second of that arm (None: fewer than ``MIN_STEPS``)."""
        b = self._row(batch)
        arm = DRAFTING if drafting else PLAIN
        if self.steps[b, arm] < MIN_STEPS or self.seconds[b, arm] <= 0:
            return None
        return float(self.tokens[b, arm] / self.seconds[b, arm])

    def check(self, batch: int) -> Verdict:
        """Whether a step of ``batch`` requests whose prices call for head drafts runs them.

        Called once per such step (it counts the band's steps and runs its probes)."""
        b = self._row(batch)
        if self.probe_left[b] > 0:
            self.probe_left[b] -= 1
            drafting = self.probe_arm[b] == DRAFTING
            return Verdict(drafting, "probe" if drafting else "plain probe")
        drafting_rate, plain_rate = self.rate(batch, True), self.rate(batch, False)
        self.since_probe[b] += 1
        due = self.since_probe[b] > PROBE_EVERY
        if drafting_rate is None or plain_rate is None:
            # Plain decoding's rate is the bar: probed as soon as drafting's is measured (waiting
            # for a due probe, batch 16 drafted its first 48 steps at 0.6x plain decoding's rate).
            if plain_rate is None and (due or drafting_rate is not None):
                return self._probe(b, PLAIN)
            return Verdict(True, "no evidence")
        if drafting_rate >= plain_rate:
            return self._probe(b, PLAIN) if due else Verdict(True, "evidence")
        if due:
            return self._probe(b, DRAFTING)
        self.vetoed += 1
        return Verdict(False, "vetoed")

    def _probe(self, b: int, arm: int) -> Verdict:
        self.probes += 1
        self.since_probe[b] = 0
        self.probe_arm[b] = arm
        self.probe_left[b] = PROBE_STEPS - 1
        drafting = arm == DRAFTING
        return Verdict(drafting, "probe" if drafting else "plain probe")

    def state(self) -> np.ndarray:
        """Everything measured and scheduled, as one float64 vector."""
        counts = np.array([self.probes, self.vetoed], dtype=np.float64)
        arrays = (self.tokens, self.seconds, self.steps, self.since_probe, self.probe_left, self.probe_arm)
        return np.concatenate([*(a.ravel() for a in arrays), counts])

    def load_state(self, state: np.ndarray) -> None:
        """Take another engine's :meth:`state` (same ``max_batch``)."""
        bands = len(self.since_probe)
        parts = np.split(state[:-2], np.cumsum([2 * bands, 2 * bands, 2 * bands, bands, bands])[:5])
        self.tokens, self.seconds, self.steps = (p.reshape(bands, 2).copy() for p in parts[:3])
        self.since_probe, self.probe_left, self.probe_arm = (p.copy() for p in parts[3:])
        self.probes, self.vetoed = int(state[-2]), int(state[-1])

    def summary(self) -> dict:
        """Measured rates (tokens/s) by band's smallest batch, with the probes run and steps vetoed."""
        rates = {}
        for b in range(len(self.steps)):
            drafting, plain = self.rate(1 << b, True), self.rate(1 << b, False)
            if drafting is not None or plain is not None:
                rates[str(1 << b)] = {
                    "drafting": None if drafting is None else round(drafting, 2),
                    "plain": None if plain is None else round(plain, 2),
                }
        return {"measured_rates": rates, "probes": self.probes, "steps_vetoed": self.vetoed}
