"""Request preparation (chat templating, tokenizing, token-id checks) off the event loop.

A multi-megabyte prompt takes the tokenizer seconds; on the event loop that would stall every
other stream. One worker thread, as vLLM does: the Hugging Face fast tokenizer is not safe to
call from several threads at once, and one thread already keeps the loop free (a big prompt
delays other requests' tokenizing, not their tokens).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class PreparePool:
    def __init__(self, num_threads: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=num_threads,
                                            thread_name_prefix="deepinfer-prepare")

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
