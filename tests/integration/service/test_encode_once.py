"""A string prompt is encoded once, in a worker thread, by the asked model's tokenizer; the engine
takes those ids. Only a fallback with its own tokenizer encodes the text again, in a worker thread too."""

import threading

COMPLETIONS = "/v1/completions"


def count_encodes(engine) -> list[str]:
    """Spy on the real tokenizer: record the thread of each encode, then run it."""
    tokenizer, calls = engine.engine.tokenizer, []
    real = tokenizer.encode

    def encode(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    tokenizer.encode = encode
    return calls


async def test_a_completion_encodes_its_prompt_once_off_the_event_loop(start):
    h = await start()
    calls = count_encodes(h.primary)
    response = await h.client.post(
        COMPLETIONS,
        json={"prompt": "def add(a, b):\n", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    )
    assert response.status == 200 and (await response.json())["usage"]["completion_tokens"] == 3
    assert len(calls) == 1 and calls[0] != threading.main_thread().name, calls


async def test_a_fallback_encodes_the_text_with_its_own_tokenizer(start):
    h = await start()
    primary_calls, fallback_calls = count_encodes(h.primary), count_encodes(h.engines["fallback"])
    h.state.router.breaker(
        "primary"
    ).circuit.open()  # pybreaker's own: the primary is skipped, the fallback serves
    response = await h.client.post(
        COMPLETIONS,
        json={"prompt": "def add(a, b):\n", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    )
    assert response.status == 200 and response.headers["x-pagedserve-served-model"] == "fallback"
    assert (len(primary_calls), len(fallback_calls)) == (1, 1), (primary_calls, fallback_calls)
    assert threading.main_thread().name not in primary_calls + fallback_calls  # never on the event loop
