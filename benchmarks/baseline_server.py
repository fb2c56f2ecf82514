"""A naive baseline: the same OpenAI API served by HF `model.generate` in static FIFO batches.

    python benchmarks/baseline_server.py --model models/pagedserve-coder-small --port 8100 --max-batch 32

One worker thread takes the oldest waiting request plus whatever queued behind it (up to --max-batch,
with the same sampling settings), left-pads them, runs `generate` until the longest is done, and only
then answers all of them. A stream therefore gets its whole completion as one chunk, then [DONE]: that
is how static batching behaves, and what pagedserve's continuous batching is measured against.
Serves /v1/completions, /v1/chat/completions (stream or not), /v1/models, /health{,/live,/ready}.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from aiohttp import web

logger = logging.getLogger("baseline_server")


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future = field(repr=False)

    @property
    def sampling(self) -> tuple[float, float]:
        return (self.temperature, self.top_p) if self.temperature > 0 else (0.0, 1.0)


@dataclass(frozen=True)
class Output:
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str  # "stop" | "length"


class StaticBatcher:
    """FIFO queue -> one batch at a time through `generate`, in a thread so the event loop stays up."""

    def __init__(self, model, tokenizer, max_batch: int, batch_wait_s: float, max_queue: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.held: Job | None = None  # head of the next batch: its sampling differed from the last one
        self.is_stopping = False
        self.eos_ids = set(_as_list(model.generation_config.eos_token_id) or [tokenizer.eos_token_id])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.thread = threading.Thread(target=self._run, name="static-batcher", daemon=True)

    def submit(self, job: Job) -> None:
        self.jobs.put_nowait(job)  # queue.Full -> 503 in the handler

    def _run(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                outputs = self._generate(batch)
            except Exception as e:  # a failed batch fails its requests, never the thread
                logger.exception("batch of %d failed", len(batch))
                for job in batch:
                    job.loop.call_soon_threadsafe(_set_exception, job.future, e)
                continue
            for job, output in zip(batch, outputs, strict=True):
                job.loop.call_soon_threadsafe(_set_result, job.future, output)

    def _next_batch(self) -> list[Job] | None:
        if self.held is not None:
            head, self.held = self.held, None
        elif self.is_stopping:
            return None
        else:
            head = self.jobs.get()
        if head is None:
            return None
        batch, deadline = [head], time.monotonic() + self.batch_wait_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                job = self.jobs.get(timeout=remaining) if remaining > 0 else self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self.is_stopping = True
                break
            if job.sampling != head.sampling:
                self.held = job  # keeps FIFO order: it heads the next batch
                break
            batch.append(job)
        return batch

    @torch.inference_mode()
    def _generate(self, batch: list[Job]) -> list[Output]:
        width = max(len(j.prompt_ids) for j in batch)
        # left padding: every row's last prompt token sits in the same column
        ids = torch.tensor([[self.pad_id] * (width - len(j.prompt_ids)) + j.prompt_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_ids)) + [1] * len(j.prompt_ids) for j in batch])
        temperature, top_p = batch[0].sampling
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_p": top_p}
            if temperature
            else {"do_sample": False}
        )
        out = self.model.generate(
            input_ids=ids.to(self.model.device),
            attention_mask=mask.to(self.model.device),
            max_new_tokens=max(j.max_tokens for j in batch),
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
            **sampling,
        )
        return [self._output(job, out[row, width:].tolist()) for row, job in enumerate(batch)]

    def _output(self, job: Job, new_ids: list[int]) -> Output:
        ids = new_ids[: job.max_tokens]
        finish = "length"
        for i, token_id in enumerate(ids):
            if token_id in self.eos_ids:
                ids, finish = ids[:i], "stop"
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in job.stop:
            if s in text:
                text, finish = text[: text.index(s)], "stop"
        return Output(text, len(job.prompt_ids), len(ids), finish)

    def close(self) -> None:
        self.is_stopping = True  # no batch after the running one, even when the queue has no room for None
        with contextlib.suppress(queue.Full):
            self.jobs.put_nowait(None)
        self.thread.join(timeout=30)


def _set_result(future: asyncio.Future, output: Output) -> None:
    if not future.done():
        future.set_result(output)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _as_list(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


# --- HTTP -------------------------------------------------------------------------------------------

BATCHER = web.AppKey("batcher", StaticBatcher)
MODEL_NAME = web.AppKey("model_name", str)
MAX_MODEL_LEN = web.AppKey("max_model_len", int)


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@web.middleware
async def openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestError as e:
        return web.json_response(
            {"error": {"message": str(e), "type": e.kind, "code": e.status}},
            status=e.status,
            headers={"Retry-After": "1"} if e.status == 503 else None,
        )


async def models(request: web.Request) -> web.Response:
    entry = {"id": request.app[MODEL_NAME], "object": "model", "created": 0, "owned_by": "baseline"}
    return web.json_response({"object": "list", "data": [entry]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(400, "prompt must be a string")
    return await _serve(request, body, prompt, is_chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await _json_body(request)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list")
    tokenizer = request.app[BATCHER].tokenizer
    if not tokenizer.chat_template:
        raise RequestError(400, "this model has no chat template")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return await _serve(request, body, prompt, is_chat=True)


async def _json_body(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError(400, "body must be a JSON object")
    if body.get("model") not in (None, request.app[MODEL_NAME]):
        raise RequestError(404, f"model {body['model']!r} not found", "model_not_found")
    if body.get("n", 1) != 1:
        raise RequestError(400, "only n=1 is supported")
    return body


def _job(request: web.Request, body: dict, prompt: str) -> Job:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
    temperature, top_p = body.get("temperature", 1.0), body.get("top_p", 1.0)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
    if not isinstance(temperature, int | float) or not isinstance(top_p, int | float) or temperature < 0:
        raise RequestError(400, "temperature and top_p must be numbers, temperature >= 0")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    prompt_ids = request.app[BATCHER].tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(prompt_ids) + max_tokens > request.app[MAX_MODEL_LEN]:
        raise RequestError(
            400,
            f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed the "
            f"model's {request.app[MAX_MODEL_LEN]}",
        )
    future = asyncio.get_running_loop().create_future()
    return Job(
        prompt_ids,
        max_tokens,
        float(temperature),
        float(top_p),
        list(stop),
        asyncio.get_running_loop(),
        future,
    )


async def _serve(request: web.Request, body: dict, prompt: str, is_chat: bool) -> web.StreamResponse:
    job = _job(request, body, prompt)
    try:
        request.app[BATCHER].submit(job)
    except queue.Full as e:
        raise RequestError(503, "queue full", "overloaded") from e
    output = await job.future
    rid, name = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}", request.app[MODEL_NAME]
    usage = {
        "prompt_tokens": output.num_prompt_tokens,
        "completion_tokens": output.num_output_tokens,
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
    }
    if not body.get("stream"):
        choice = {"index": 0, "finish_reason": output.finish_reason}
        choice |= (
            {"message": {"role": "assistant", "content": output.text}}
            if is_chat
            else {"text": output.text, "logprobs": None}
        )
        obj = "chat.completion" if is_chat else "text_completion"
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": name,
                "choices": [choice],
                "usage": usage,
            }
        )
    return await _stream(request, body, output, rid, usage, is_chat)


async def _stream(
    request: web.Request, body: dict, output: Output, rid: str, usage: dict, is_chat: bool
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if is_chat else "text_completion",
        "created": int(time.time()),
        "model": request.app[MODEL_NAME],
    }
    delta = {"delta": {"role": "assistant", "content": output.text}} if is_chat else {"text": output.text}
    chunks = [
        {**head, "choices": [{"index": 0, **delta, "finish_reason": None}]},
        {
            **head,
            "choices": [
                {
                    "index": 0,
                    **({"delta": {}} if is_chat else {"text": ""}),
                    "finish_reason": output.finish_reason,
                }
            ],
        },
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": usage})
    try:
        await response.prepare(request)
        for chunk in chunks:
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left while its batch ran; the work is done anyway
        logger.info("%s: client gone before its stream was written", rid)
    return response


def create_app(batcher: StaticBatcher, model_name: str, max_model_len: int) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=8 * 1024 * 1024)
    app[BATCHER], app[MODEL_NAME], app[MAX_MODEL_LEN] = batcher, model_name, max_model_len

    async def batcher_ctx(app: web.Application):
        batcher.thread.start()
        yield
        await asyncio.to_thread(batcher.close)

    app.cleanup_ctx.append(batcher_ctx)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    for path in ("/health", "/health/live", "/health/ready"):
        app.router.add_get(path, health)
    return app


def load(model_dir: Path, dtype: str, device: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach a hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    return model, tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="local HF model directory")
    p.add_argument("--served-model-name", default=None, help="default: the directory's name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait this long for a batch to fill")
    p.add_argument("--max-queue", type=int, default=1024, help="waiting requests beyond this get 503")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on CPU")
    args = p.parse_args()
    if args.max_batch < 1:
        p.error(f"--max-batch must be at least 1, got {args.max_batch}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.dtype, args.device)
    max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
    batcher = StaticBatcher(model, tokenizer, args.max_batch, args.batch_wait_ms / 1000, args.max_queue)
    name = args.served_model_name or args.model.resolve().name
    logger.info(
        "serving %s (%s, %s) on %s:%d, static batches of up to %d",
        name,
        args.dtype,
        args.device,
        args.host,
        args.port,
        args.max_batch,
    )
    web.run_app(create_app(batcher, name, max_model_len), host=args.host, port=args.port, access_log=None)


if __name__ == "__main__":
    main()
