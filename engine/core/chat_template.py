"""Chat templates are code from a model directory (jinja2, rendered in transformers' sandbox). The
sandbox stops attribute escapes but not a template that loops 10^10 times or renders gigabytes,
which would pin a worker thread until the kernel kills the replica. `render_bounded` gives one
render a wall-clock budget and an output cap; past the budget the rendering thread is interrupted
(an asynchronous exception: jinja2 renders in Python bytecode, which checks for one between
instructions)."""

import ctypes
import threading
from collections.abc import Callable

from jinja2 import TemplateError

from engine.errors import RequestRejectedError

RENDER_TIMEOUT_S = 2.0
MAX_RENDERED_CHARS = 16 << 20
MAX_TEMPLATE_ERROR_CHARS = 300


class _RenderTimeout(BaseException):  # BaseException: a template's own `except Exception` cannot catch it
    pass


def render_bounded(
    render: Callable[[], str], timeout_s: float = RENDER_TIMEOUT_S, max_chars: int = MAX_RENDERED_CHARS
) -> str:
    """`render()` on this thread, interrupted after `timeout_s`; RequestRejectedError if it runs out
    of time or renders more than `max_chars`."""
    thread_id, lock, finished = threading.get_ident(), threading.Lock(), []

    def interrupt() -> None:
        with lock:  # never once render returned: the exception would land in the caller's code
            if not finished:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(thread_id), ctypes.py_object(_RenderTimeout)
                )

    timer = threading.Timer(timeout_s, interrupt)
    timer.daemon = True
    try:
        try:
            timer.start()
            text = render()
        finally:
            with lock:
                finished.append(True)
            timer.cancel()
    except _RenderTimeout:
        raise RequestRejectedError(f"the chat template did not render within {timeout_s:g} s") from None
    if len(text) > max_chars:
        raise RequestRejectedError(
            f"the chat template rendered {len(text)} characters, more than {max_chars}"
        )
    return text


def encode_prompt(tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids: a text encoded as HF and vLLM encode it, the tokenizer's special tokens (a
    BOS) included unless `add_special_tokens` is False (a rendered chat template has its own); ids as
    they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return list(prompt)


def chat_prompt(
    tokenizer, chat_template: str | None, messages: list[dict], tools: list[dict] | None = None
) -> str:
    """The prompt of a conversation; `tools` (OpenAI function definitions) reach a template that
    knows them (one that does not ignores them)."""
    if not chat_template:
        raise RequestRejectedError("this model has no chat template; use the completions API")
    try:
        return render_bounded(
            lambda: tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
        )
    except TemplateError as exc:  # raise_exception(), an undefined name, the sandbox, a syntax error: a 400
        raise RequestRejectedError(
            f"the chat template failed on these messages ({exc.__class__.__name__}): "
            f"{str(exc)[:MAX_TEMPLATE_ERROR_CHARS]}"
        ) from None
