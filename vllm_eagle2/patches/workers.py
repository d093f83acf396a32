"""Engine start-up and RPCs on vLLM's workers (vLLM 0.32 ``v1/worker/gpu_worker.py``; on CPU only
``v1/worker/cpu_worker.py``, whose import swaps torch.cuda's classes for stand-ins process-wide)."""

from __future__ import annotations

from typing import Any

from .record import set_attr


def _drafter(worker: Any) -> Any:
    """The worker's eagle2 drafter; None in an engine without eagle2."""
    from vllm_eagle2.engine.proposer import Eagle2Proposer

    drafter = getattr(worker.model_runner, "drafter", None)
    return drafter if isinstance(drafter, Eagle2Proposer) else None


def budget_summary(worker: Any) -> dict[str, Any] | None:
    """The adaptive budget's counters, for ``LLM.collective_rpc("eagle2_budget_summary")``.

    None when the engine does not run eagle2 with the adaptive budget.
    """
    budget = getattr(_drafter(worker), "budget", None)
    return None if budget is None else budget.summary()


def verify_stats(worker: Any) -> dict[str, int] | None:
    """What the tree verification exercised, for ``LLM.collective_rpc("eagle2_stats")``:
    :class:`vllm_eagle2.engine.verification.VerifyCounters`, and with lookup chains
    ``lookup_drafts`` / ``lookup_accepted`` (grafted drafts verified / accepted). None when the
    engine does not run eagle2."""
    drafter = _drafter(worker)
    if drafter is None:
        return None
    lookup = {} if drafter.lookup is None else drafter.lookup.summary()
    head = {
        "requests_without_drafts": drafter.eligible.refused,  # sampling the verifier does not reproduce
        "head_passes": drafter.head_passes,
        **drafter.catch_up.summary(),
    }
    return {**drafter.counters.summary(), **lookup, **head}


def patch_workers() -> None:
    """After vLLM's warm-up the adaptive budget times the target and one draft level; on the GPU
    worker every Triton variant of eagle2's kernels compiles just before vLLM's JIT monitor starts
    watching; the two RPCs above."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_eagle2.engine import startup

    classes = [Worker]
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        classes.append(CPUWorker)
    for cls in classes:
        warm_up = cls.compile_or_warm_up_model

        def compile_or_warm_up_model(self, *args, _warm_up=warm_up, **kwargs):
            out = _warm_up(self, *args, **kwargs)
            drafter = _drafter(self)
            if drafter is not None:
                startup.calibrate_budget(drafter, self.model_runner)
            return out

        set_attr(cls, "compile_or_warm_up_model", compile_or_warm_up_model)
        set_attr(cls, "eagle2_budget_summary", budget_summary)
        set_attr(cls, "eagle2_stats", verify_stats)

    activate_monitor = Worker._maybe_activate_jit_monitor

    def _maybe_activate_jit_monitor(self, *args, **kwargs):
        drafter = _drafter(self)
        if drafter is not None:
            startup.warm_up(drafter)
        return activate_monitor(self, *args, **kwargs)

    set_attr(Worker, "_maybe_activate_jit_monitor", _maybe_activate_jit_monitor)
