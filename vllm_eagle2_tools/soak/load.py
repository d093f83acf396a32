"""The soak test's load: concurrent clients streaming completions with a seeded request mix."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ERROR_BACKOFF_S = 0.5  # a client's pause after a failed request


@dataclass
class RequestRecord:
    """One request as the client saw it (times in seconds from the start of the load)."""

    client: int
    start_s: float
    end_s: float = 0.0
    first_token_s: float | None = None
    status: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    temperature: float = 0.0
    tokens: int = 0
    done: bool = False  # [DONE] arrived
    error: str | None = None  # "http_5xx", "http_4xx", "stream_error", "cut", "exception:Type"
    detail: str | None = None


@dataclass
class PromptSource:
    """Token ids to draw prompts from (special and added tokens left out)."""

    ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, target: Path) -> PromptSource:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target))
        banned = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        return cls([i for i in range(len(tokenizer)) if i not in banned])


async def one_request(
    client: Any, base_url: str, body: dict[str, Any], record: RequestRecord, t0: float
) -> None:
    """Stream one completion into ``record``; never raises."""
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as reply:
            record.status = reply.status_code
            if reply.status_code >= 400:
                record.error = "http_5xx" if reply.status_code >= 500 else "http_4xx"
                record.detail = (await reply.aread()).decode(errors="replace")[:300]
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    record.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = "stream_error"
                    record.detail = json.dumps(chunk["error"])[:300]
                    continue
                for choice in chunk.get("choices", []):
                    got = len(choice.get("token_ids") or [])
                    if got and record.first_token_s is None:
                        record.first_token_s = time.monotonic() - t0
                    record.tokens += got
        if record.error is None and not record.done:
            record.error = "cut"
    except Exception as error:  # noqa: BLE001 - every failure is a result here
        record.error = f"exception:{type(error).__name__}"
        record.detail = str(error)[:300]
    finally:
        record.end_s = time.monotonic() - t0


async def run_load(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    prompts: PromptSource,
    server_alive: Callable[[], bool],
) -> list[RequestRecord]:
    """``args.clients`` clients send requests back to back until ``args.duration_s`` has passed.

    The load ends early when the server process has exited; after a failed request a client
    waits a moment before its next one (no tight loop against a dead server).
    """
    import httpx

    t0 = time.monotonic()
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)

    async def client_loop(index: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(args.seed * 100_003 + index)
        while time.monotonic() - t0 < args.duration_s and server_alive():
            length = rng.randint(5, args.max_prompt_tokens)
            max_tokens = rng.randint(1, args.max_tokens)
            sampled = rng.random() < 0.5
            body: dict[str, Any] = {
                "model": model,
                "prompt": [rng.choice(prompts.ids) for _ in range(length)],
                "max_tokens": max_tokens,
                "temperature": 0.8 if sampled else 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": True,
            }
            if sampled:
                body["seed"] = rng.randrange(2**31)
            record = RequestRecord(index, time.monotonic() - t0, prompt_tokens=length, max_tokens=max_tokens)
            record.temperature = body["temperature"]
            records.append(record)
            try:
                await asyncio.wait_for(
                    one_request(client, base_url, body, record, t0), args.request_timeout_s
                )
            except asyncio.TimeoutError:
                record.error, record.end_s = "exception:Timeout", time.monotonic() - t0
            if record.error is not None:
                await asyncio.sleep(ERROR_BACKOFF_S)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = [asyncio.create_task(client_loop(i, client)) for i in range(args.clients)]
        # Hard bound: the last requests start before duration_s and each is bounded by its timeout.
        _, pending = await asyncio.wait(tasks, timeout=args.duration_s + args.request_timeout_s + 30)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records
