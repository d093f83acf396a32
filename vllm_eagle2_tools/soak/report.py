"""The soak test's report: throughput, latency, errors, memory growth and vLLM's counters."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from vllm_eagle2_tools.soak.load import RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def server_counters(base_url: str) -> dict[str, float]:
    """A few of vLLM's /metrics counters (summed over labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vllm:num_preemptions_total",
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
    }
    page = httpx.get(f"{base_url}/metrics", timeout=30)
    page.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(page.text):
        for sample in family.samples:
            if sample.name in wanted:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def summarize(
    args: argparse.Namespace,
    records: list[RequestRecord],
    samples: list[dict[str, Any]],
    load_s: float,
    health: int | None,
    counters: dict[str, float],
    server_alive: bool,
) -> dict[str, Any]:
    """The report: throughput, latency, errors, memory, vLLM counters, and an overall ``ok``."""
    measured = [r for r in records if r.start_s >= args.warmup_s and r.error is None]
    window = max(load_s - args.warmup_s, 1e-9)
    latencies = [r.end_s - r.start_s for r in measured]
    ttfts = [r.first_token_s - r.start_s for r in measured if r.first_token_s is not None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    error_examples = [asdict(r) for r in records if r.error is not None][:5]

    after_warmup = next((s for s in samples if s["t_s"] >= args.warmup_s), samples[-1] if samples else None)
    end = samples[-1] if samples else None
    growth = None
    if after_warmup and end and after_warmup["rss_bytes"] > 0:
        growth = end["rss_bytes"] / after_warmup["rss_bytes"] - 1.0
    memory_flag = growth is not None and growth > args.memory_growth_limit
    # RSS also grows while KV-cache pages are touched for the first time; a leak keeps growing in
    # the second half of the load as well.
    middle = next((s for s in samples if s["t_s"] >= load_s / 2), None)
    second_half = (
        end["rss_bytes"] / middle["rss_bytes"] - 1.0 if middle and end and middle["rss_bytes"] else None
    )
    mib = 1 << 20
    memory = {
        "after_warmup_mib": after_warmup["rss_bytes"] / mib if after_warmup else None,
        "end_mib": end["rss_bytes"] / mib if end else None,
        "peak_mib": max(s["rss_bytes"] for s in samples) / mib if samples else None,
        "growth": growth,
        "growth_second_half": second_half,
        "growth_limit": args.memory_growth_limit,
        "growth_flagged": memory_flag,
        "by_process_mib": {
            name: {
                "after_warmup": round(rss / mib, 1),
                "end": round(end["by_process"].get(name, 0.0) / mib, 1),
            }
            for name, rss in (after_warmup["by_process"].items() if after_warmup and end else [])
        },
        "samples": [{"t_s": round(s["t_s"], 1), "rss_mib": round(s["rss_bytes"] / mib, 1)} for s in samples],
    }
    drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    report = {
        "config": {
            "model": "tiny partial pair" if args.tiny else str(args.target),
            "spec": (
                {"method": "eagle2", "m": args.num_speculative_tokens, "depth": args.depth, "topk": args.topk}
                if args.spec
                else None
            ),
            "clients": args.clients,
            "duration_s": args.duration_s,
            "warmup_s": args.warmup_s,
            "max_prompt_tokens": args.max_prompt_tokens,
            "max_tokens": args.max_tokens,
        },
        "requests": {
            "total": len(records),
            "ok": sum(r.error is None for r in records),
            "measured_after_warmup": len(measured),
            "requests_per_s": len(measured) / window,
            "generated_tokens_per_s": sum(r.tokens for r in measured) / window,
            "load_s": load_s,
        },
        "latency_s": {
            "p50": percentile(latencies, 50),
            "p99": percentile(latencies, 99),
            "max": max(latencies, default=None),
            "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99),
        },
        "errors": {
            "total": sum(errors.values()),
            "http_5xx": errors.get("http_5xx", 0),
            "by_kind": errors,
            "examples": error_examples,
        },
        "server": {
            "health_after_load": health,
            "alive_after_load": server_alive,
            "preemptions": counters.get("vllm:num_preemptions_total"),
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "kv_cache_usage_after_load": counters.get("vllm:kv_cache_usage_perc"),
        },
        "memory": memory,
    }
    report["ok"] = bool(records) and not errors and not memory_flag and health == 200 and server_alive
    return report
