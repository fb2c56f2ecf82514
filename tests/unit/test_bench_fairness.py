"""benchmarks/fairness.py's set-up, without running it: the tenants file it writes is one the server
accepts, each tenant's key names its tenant, and the FIFO server takes the same keys without tenants."""

import argparse
import tomllib
from pathlib import Path

from benchmarks.fairness import KEYS, TENANTS_FILE, server_command
from service.tenants import parse_tenants


def test_the_benchmarks_tenants_file_names_both_tenants():
    tenants = parse_tenants(tomllib.loads(TENANTS_FILE))
    assert {name: tenants.for_key(key).name for name, key in KEYS.items()} == {
        "flood": "flood",
        "chat": "chat",
    }
    assert all(t.weight == 1.0 and t.tokens_per_minute is None for t in tenants.tenants)  # fairness alone


def test_both_servers_take_both_keys_and_only_one_has_tenants():
    args = argparse.Namespace(model=Path("/m"), pagedserve_args="--max-num-batched-tokens 256")
    with_tenants = server_command(args, 8000, Path("/t.toml"))
    fifo = server_command(args, 8000, None)
    assert with_tenants[-4:] == ["--tenants", "/t.toml", "--max-num-batched-tokens", "256"]
    assert "--tenants" not in fifo and [fifo[i + 1] for i, a in enumerate(fifo) if a == "--api-key"] == list(
        KEYS.values()
    )
    assert (
        with_tenants[with_tenants.index("--max-queue-delay") + 1]
        == fifo[fifo.index("--max-queue-delay") + 1]
        == "0"
    )
