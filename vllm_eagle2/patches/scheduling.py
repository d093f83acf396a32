"""Drafts reach the scheduler with the step's output (vLLM 0.32 ``v1/engine/core.py``,
``v1/core/sched/scheduler.py``): an eagle2 engine schedules synchronously (vLLM 0.32 runs every
speculative method outside its own list so), and vLLM would otherwise fetch the drafts in a third
call to the worker per step (``take_draft_token_ids`` from ``post_step``)."""

from __future__ import annotations

from .model_runner import DRAFTS_ATTR
from .record import set_attr


def patch_scheduling() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    update_from_output = Scheduler.update_from_output

    def _update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        out = update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        drafts = getattr(model_runner_output, DRAFTS_ATTR, None)
        if drafts is not None:  # what post_step would have fetched from the worker next
            self.update_draft_token_ids(drafts)
        return out

    post_step = EngineCore.post_step

    def _post_step(self, model_executed: bool) -> None:
        spec = self.vllm_config.speculative_config
        if spec is not None and spec.method == "eagle2" and not self.async_scheduling:
            return  # the drafts came with the step's output (update_from_output took them)
        post_step(self, model_executed)

    set_attr(Scheduler, "update_from_output", _update_from_output)
    set_attr(EngineCore, "post_step", _post_step)
