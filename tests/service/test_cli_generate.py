"""`pagedserve generate --model DIR "prompt"` prints what `engine.LLM` completes."""

from engine.sampling_params import SamplingParams
from service.cli import main
from tests.service.server import TINY, require_models

PROMPT = "def add(a, b):\n"


def test_generate_prints_the_greedy_completion(capsys):
    require_models(TINY)
    assert main(["generate", "--model", str(TINY), "--max-tokens", "8", "--log-level", "warning", PROMPT]) == 0
    printed = capsys.readouterr().out

    from engine import LLM

    expected = LLM(model=str(TINY)).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert printed == expected[0].outputs[0].text + "\n"


def test_generate_reports_a_bad_option(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--block-size", "12", "hi"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err
