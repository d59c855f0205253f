"""Drive a client with a list of prompts: closed loop at a fixed concurrency, or Poisson arrivals.

closed_loop   `concurrency` workers, each sending its next prompt as soon as its previous
              answer ended (vLLM's `--max-concurrency c` with an infinite request rate)
poisson       requests sent at exponential inter-arrival times of mean 1/rate (seeded), at most
              `max_concurrency` in flight when given

Both return the per-request results and the wall time from the first send to the last answer.
A tqdm bar on stderr counts finished requests.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

from tqdm import tqdm

from benchmarks.clients import Client
from benchmarks.stats import RequestResult
from benchmarks.workload import Prompt


def _bar(total: int, label: str, show: bool) -> tqdm:
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, disable=not show, leave=False)


async def closed_loop(
    client: Client, prompts: list[Prompt], concurrency: int, label: str = "", progress: bool = True
) -> tuple[list[RequestResult], float]:
    results: list[RequestResult | None] = [None] * len(prompts)
    next_index = 0
    bar = _bar(len(prompts), label, progress)

    async def worker() -> None:
        nonlocal next_index
        while next_index < len(prompts):
            index = next_index
            next_index += 1
            results[index] = await client.generate(prompts[index])
            bar.update(1)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    finally:
        bar.close()
    duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration


async def poisson(
    client: Client,
    prompts: list[Prompt],
    rate: float,
    max_concurrency: int | None = None,
    seed: int = 0,
    label: str = "",
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = _bar(len(prompts), label, progress)

    async def one(prompt: Prompt) -> RequestResult:
        if limit is None:
            result = await client.generate(prompt)
        else:
            async with limit:
                result = await client.generate(prompt)
        bar.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    try:
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(one(prompt)))
            if i + 1 < len(prompts):
                await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return results, time.perf_counter() - start
