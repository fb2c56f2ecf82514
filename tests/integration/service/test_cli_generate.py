"""`pagedserve generate --model DIR "prompt"` runs `engine.LLM` on a real tiny model and prints the text:
the same text the engine generates itself, with the options and sampling parameters the CLI was given."""

from engine import LLM
from engine.sampling_params import SamplingParams
from service.cli import main

PROMPT = "def add(a, b):"
OPTIONS = [
    "--dtype",
    "float32",
    "--device",
    "cpu",
    "--block-size",
    "8",
    "--kv-cache-memory",
    "1MiB",
    "--max-model-len",
    "128",
    "--num-threads",
    "1",
]


def _generate(capsys, model, *args: str) -> str:
    assert main(["generate", "--model", str(model), *OPTIONS, *args, PROMPT]) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    return captured.out[:-1]


def test_generate_prints_the_greedy_completion(tiny_models, capsys):
    llm = LLM(
        model=str(tiny_models.primary),
        dtype="float32",
        device="cpu",
        block_size=8,
        kv_cache_memory=2**20,
        max_model_len=128,
    )
    expected = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[
        0
    ].outputs[0]
    assert expected.text.strip() and len(expected.token_ids) <= 8
    assert (
        _generate(capsys, tiny_models.primary, "--max-tokens", "8") == expected.text
    )  # temperature 0 by default
    longer = _generate(capsys, tiny_models.primary, "--max-tokens", "16")
    assert longer.startswith(expected.text)  # greedy: more tokens extend the same text


def test_generate_samples_with_the_seed_it_is_given(tiny_models, capsys):
    sampled = ["--max-tokens", "12", "--temperature", "1.0"]
    texts = [
        _generate(capsys, tiny_models.fallback, *sampled, "--seed", seed) for seed in ("3", "3", "4", "5")
    ]
    assert texts[0] == texts[1]  # the random tiny Qwen2: near-uniform logits, so seeds tell apart surely
    assert len(set(texts[1:])) == 3, texts


def test_generate_reports_a_bad_option(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--block-size", "12", "hi"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_generate_reports_a_missing_model(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedserve: ") and "nowhere" in err and "does not exist" in err, err


def test_generate_hands_the_engine_options_to_the_engine(tiny_models, capsys):
    """The real engine's own sizing check, quoting block_size, kv_cache_memory and max_model_len back."""
    argv = [
        "generate",
        "--model",
        str(tiny_models.primary),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--block-size",
        "8",
        "--kv-cache-memory",
        "64KiB",
        "--max-model-len",
        "128",
        PROMPT,
    ]
    assert main(argv) == 2
    # 4 layers x 2 KV heads x 48 dims x float32 x K and V x 8 tokens = 24576 bytes a block: 64 KiB holds 2
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line == (
        "pagedserve: KV budget holds 2 blocks of 8 tokens (24576 bytes each), too few for one "
        "sequence of max_model_len 128; raise kv_cache_memory or lower max_model_len"
    )


def test_generate_takes_the_attention_backend(tiny_models, capsys):
    """--attention-backend flex (CUDA's default) gives the torch backend's greedy text; a bad one is refused."""
    torch_text = _generate(capsys, tiny_models.primary, "--max-tokens", "8", "--attention-backend", "torch")
    assert (
        _generate(capsys, tiny_models.primary, "--max-tokens", "8", "--attention-backend", "flex")
        == torch_text
    )
    assert main(["generate", "--model", str(tiny_models.primary), "--attention-backend", "triton", "hi"]) == 2
    assert "attention_backend must be one of" in capsys.readouterr().err
