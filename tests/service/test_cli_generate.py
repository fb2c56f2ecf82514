"""`pagedserve generate --model DIR "prompt"` hands its options to `engine.LLM` and prints the text.

The engine's own LLM is tested in tests/engine; here a stand-in records what the CLI asked for, so
the test needs no torch (a real load would cost the suite ~20 s for what tests/engine covers)."""

import engine
from engine.outputs import CompletionOutput, RequestOutput
from service.cli import main


class RecordingLLM:
    calls: list = []

    def __init__(self, model: str, **options) -> None:
        self.calls.append(("init", model, options))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", prompts, params, use_tqdm))
        return [RequestOutput("0", prompts[0], [1], [CompletionOutput(0, "    return a + b", [2, 3], "length")])]


def test_generate_prints_the_completion(monkeypatch, capsys):
    monkeypatch.setitem(vars(engine), "LLM", RecordingLLM)  # setattr would import the real one first
    RecordingLLM.calls = []
    argv = ["generate", "--model", "/m/tiny", "--max-tokens", "8", "--temperature", "0.5", "--seed", "3",
            "--block-size", "8", "--kv-cache-memory", "1MiB", "def add(a, b):\n"]
    assert main(argv) == 0
    assert capsys.readouterr().out == "    return a + b\n"
    (_, model, options), (_, prompts, params, use_tqdm) = RecordingLLM.calls
    assert (model, options) == ("/m/tiny", {"block_size": 8, "kv_cache_memory": 2**20})
    assert prompts == ["def add(a, b):\n"] and not use_tqdm
    assert (params.max_tokens, params.temperature, params.seed) == (8, 0.5, 3)


def test_generate_reports_a_bad_option(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(vars(engine), "LLM", RecordingLLM)
    assert main(["generate", "--model", str(tmp_path), "--block-size", "12", "hi"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err
