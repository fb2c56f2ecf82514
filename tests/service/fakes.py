"""A fake `AsyncEngine` with the real one's contract (deltas, abort on close, errors), for in-process
tests of the HTTP layer that must not wait for torch. One character = one token (id = code point)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineOverloadedError, RequestRejectedError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

# what every choice generates, one char per token: multi-byte on purpose
SCRIPT = "héllo wörld 你好🙂 and so on, until max_tokens. " * 4


class CharTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)


class FakeEngine:
    def __init__(self, config: EngineConfig, *, max_model_len: int = 64, delay: float = 0.0) -> None:
        self.config = config
        self.tokenizer = CharTokenizer()
        self.max_model_len = max_model_len
        self.delay = delay  # seconds between deltas
        self.is_dead = False
        self.dead_error: BaseException | None = None
        self.is_overloaded = False
        self.error: Exception | None = None  # raised after the first delta when set
        self.running: set[str] = set()
        self.waiting: set[str] = set()  # requests held before their first delta while `hold` is set
        self.hold = asyncio.Event()
        self.hold.set()
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.requests: list[tuple[str, str | list[int], SamplingParams, int]] = []
        self.is_started = False
        self.is_stopped = False

    @property
    def last_progress_time(self) -> float:
        return time.monotonic()  # the fake's loop never hangs

    def start(self) -> None:
        self.is_started = True

    def stop(self, timeout: float = 10) -> None:
        self.is_stopped = True

    def encode(self, prompt: str | list[int]) -> list[int]:
        return [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise RequestRejectedError("the prompt is empty")
        total = len(prompt_token_ids) + (params.max_tokens or 1)
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{total} ({len(prompt_token_ids)} in the prompt, {params.max_tokens} to generate)")

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError("the engine is dead: fake")
        if self.is_overloaded:
            raise EngineOverloadedError("waiting queue is full (1 requests)")
        ids = self.encode(prompt)
        self.check_request(ids, params)
        self.requests.append((request_id, prompt, params, priority))
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        texts = {i: self._text(params, i, max_tokens) for i in range(params.n)}
        finished = False
        self.waiting.add(request_id)
        try:
            await self.hold.wait()
            self.waiting.discard(request_id)
            self.running.add(request_id)
            for step in range(max(len(t) for t, _ in texts.values())):
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                if step == 1 and self.error is not None:
                    raise self.error
                outputs = [self._delta(i, text, reason, step, params) for i, (text, reason) in texts.items()
                           if step < len(text)]
                finished = all(step >= len(text) - 1 for text, _ in texts.values())
                yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids, outputs, finished,
                                    metrics={"arrival_time": 1.0, "first_scheduled_time": 1.25})
            self.finished.append(request_id)
        finally:
            self.waiting.discard(request_id)
            self.running.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def _text(self, params: SamplingParams, index: int, max_tokens: int) -> tuple[str, str]:
        text = SCRIPT[index:index + max_tokens]
        for stop in params.stop:
            at = text.find(stop)
            if at != -1:
                return text[:at] or " ", "stop"
        return text, "length" if len(text) == max_tokens else "stop"

    def _delta(self, index: int, text: str, reason: str, step: int, params: SamplingParams) -> CompletionOutput:
        char = text[step]
        last = step == len(text) - 1
        logprobs = None
        if params.logprobs is not None:
            logprobs = [{ord(char): -0.5, ord("x"): -1.5, ord("y"): -2.5, ord("z"): float("-inf")}]
        return CompletionOutput(index, char, [ord(char)], reason if last else None, None, logprobs)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        used = len(self.running)
        return EngineStats(num_running=used, num_waiting=len(self.waiting), num_swapped=0, num_total_blocks=8,
                           num_free_blocks=8 - min(used, 8), kv_cache_usage=min(used, 8) / 8, kv_waste=0.0,
                           prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1, num_steps=3,
                           num_prompt_tokens=len(self.requests) * 5, num_generation_tokens=7,
                           last_step_time=None, is_busy=bool(used))
