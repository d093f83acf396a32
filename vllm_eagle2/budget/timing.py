"""One step's record for the budget: its timings and what it sent, filled by the step as it runs.

The step owns its :class:`StepTimes` (``Eagle2Step.times``) and marks its phases on it; nothing is
learnt mid-step. When the next step starts, :meth:`~vllm_eagle2.budget.adaptive.AdaptiveBudget.learn`
reads the record whole: by then every CUDA event in it has passed (vLLM synced on the sampled
tokens), and the gap to that start is known.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm_eagle2.budget.costs import Clock, Mark
from vllm_eagle2.budget.decisions import DraftPlan


@dataclass(frozen=True)
class Sent:
    """What a step's drafter sent: ``plan``, its drafts per request (``counts``), and whether the
    head's levels went unrun for lookup chains alone (``head_skipped``)."""

    plan: DraftPlan
    counts: list[int]
    head_skipped: bool = False

    @property
    def total(self) -> int:
        return sum(self.counts)


@dataclass
class StepTimes:
    """The record of one step.

    clock: the budget's (host seconds on CPU, CUDA events); host: the step's start
    (``time.perf_counter``); tokens / prompt: its scheduled tokens, and whether prompt chunks are
    among them; verifies: it verifies drafts (the scheduler sent some); context: the tokens its
    requests hold on average, this step's included (what each of its rows reads).
    target: the (start, end) marks of its target pass, sampling and verification, from the drafter's
    start until the budget measures them. levels: the draft levels' (start mark, rows), the root
    level first (its catch-up pass included), closed by a (mark, 0) once drafting is done. sent:
    what the drafter sent (None: it did not run); end: the drafter's end (``time.perf_counter``).
    target_s / draft_s: seconds of the target pass and of the levels, once the clock resolves them.
    """

    clock: Clock
    host: float
    start: Mark
    tokens: int
    prompt: bool
    verifies: bool
    context: float = 0.0
    target: tuple[Mark, Mark] | None = None
    levels: list[tuple[Mark, int]] = field(default_factory=list)
    sent: Sent | None = None
    end: float | None = None
    target_s: float = 0.0
    draft_s: float = 0.0

    @classmethod
    def begin(
        cls, clock: Clock, tokens: int, prompt_tokens: int = 0, verifies: bool = False, context: float = 0.0
    ) -> StepTimes:
        """A step over ``tokens`` scheduled tokens starts, ``prompt_tokens`` of them prompt
        (prefill chunks), the rest one per decoding request and its drafts; its requests hold
        ``context`` tokens on average."""
        return cls(clock, time.perf_counter(), clock.mark(), tokens, prompt_tokens > 0, verifies, context)

    def target_done(self) -> None:
        """The target pass, sampling and verification are done: the drafter starts."""
        if self.target is None:
            self.target = (self.start, self.clock.mark())

    def level_started(self, rows: int) -> None:
        """A draft level over ``rows`` rows starts (the root level, then each expansion)."""
        self.levels.append((self.clock.mark(), rows))

    def drafting_done(self) -> None:
        """The last level ended: each level is timed from its start to the next one's."""
        if self.levels and self.levels[-1][1]:
            self.levels.append((self.clock.mark(), 0))

    def drafts_sent(self, plan: DraftPlan, counts: list[int], head_skipped: bool = False) -> None:
        """The drafter ends, having sent ``counts`` drafts per request of ``plan``."""
        self.sent = Sent(plan, counts, head_skipped)
        self.end = time.perf_counter()

    @property
    def drafted(self) -> bool:
        """It sent drafts (the next step verifies them)."""
        return self.sent is not None and self.sent.total > 0

    @property
    def lookup_only(self) -> bool:
        """It sent lookup chains alone: it built no tree."""
        sent = self.sent
        return self.drafted and (sent.head_skipped or not sent.plan.drafts)
