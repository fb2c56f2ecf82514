"""`pagedserve bench --profile` runs engine.frontend.profiler's profile with the options it parses."""

import json

import pytest

from engine.frontend.profiler import CATEGORIES
from service.cli import build_parser, main


def test_bench_profile_prints_the_table_and_writes_json(random_model, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = [
        "bench",
        "--profile",
        "--model",
        random_model(),
        "--batch-size",
        "1",
        "--prompt-len",
        "4",
        "--output-len",
        "2",
        "--device",
        "cpu",
        "--num-threads",
        "1",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in CATEGORIES)
    result = json.loads(out.read_text())
    assert result["settings"]["batch_size"] == 1 and result["settings"]["prompt_len"] == 4
    assert result["num_steps"] == 2  # one prefill step, one decode step


def test_bench_needs_profile_and_reports_bad_settings(random_model, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench"])
    assert main(["bench", "--profile", "--model", random_model(), "--batch-size", "0"]) == 2
    assert "batch_size must be at least 1, got 0" in capsys.readouterr().err
