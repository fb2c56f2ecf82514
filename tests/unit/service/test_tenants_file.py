"""--tenants FILE (service/tenants.py): what it accepts, what it refuses with a message naming the entry,
and which tenant a bearer key belongs to."""

import hashlib

import pytest

from service.cli import build_config, build_parser
from service.config import ConfigError, load_toml
from service.tenants import DEFAULT_TENANT, TenantsError, load_tenants, parse_tenants

FILE = """
[fairness]
decode_cost = 3.0
contended_prefill_tokens = 128

[tenants.search]
keys = ["sk-search", "sha256:{digest}"]
weight = 2.0
priority = 1
tokens_per_minute = 6000
burst = 800
max_concurrency = 4

[tenants.chat]
keys = ["sk-chat"]
"""


def write(tmp_path, text=None):
    path = tmp_path / "tenants.toml"
    digest = hashlib.sha256(b"sk-hashed").hexdigest()
    path.write_text(text if text is not None else FILE.replace("{digest}", digest))
    return path


def test_keys_plain_and_hashed_name_their_tenant_and_any_other_is_the_default(tmp_path):
    tenants = load_tenants(write(tmp_path))
    assert tenants.for_key("sk-search").name == "search"
    assert tenants.for_key("sk-hashed").name == "search"
    assert tenants.for_key("sk-chat").name == "chat"
    assert tenants.for_key("sk-unknown").name == tenants.for_key(None).name == DEFAULT_TENANT
    search = tenants.for_key("sk-search")
    assert (
        search.weight,
        search.priority,
        search.tokens_per_minute,
        search.burst,
        search.max_concurrency,
    ) == (
        2.0,
        1,
        6000,
        800,
        4,
    )
    share = tenants.share(search)
    assert (share.tenant, share.weight, share.prefill_cost, share.decode_cost) == ("search", 2.0, 1.0, 3.0)
    assert share.contended_prefill_tokens == 128
    assert "sk-search" not in repr(tenants)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no tenant"),
        ("[tenant.a]\n", r"unknown tables \['tenant'\]"),
        ("[tenants.a]\nweigth = 2\n", r"\[tenants.a\]: unknown keys \['weigth'\]"),
        ("[tenants.a]\nweight = -1\n", r"\[tenants.a\]: tenant 'a': weight must be a positive number"),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", r"\[tenants.b\]: a key is also 'a''s"),
        ("[tenants.a]\nkeys = ['k 1']\n", "holds whitespace"),
        ("[tenants.a]\nkeys = 'k'\n", "keys must be strings"),
        ("[tenants.default]\nkeys = ['k']\n", "the default tenant has no keys"),
        ("[fairness]\ndecode_cost = 0\n[tenants.a]\n", r"\[fairness\]: decode_cost must be a positive"),
        ("[fairness]\ncost = 1\n[tenants.a]\n", r"\[fairness\] unknown keys \['cost'\]"),
        (
            "[fairness]\ncontended_prefill_tokens = 0.5\n[tenants.a]\n",
            "contended_prefill_tokens must be an integer",
        ),
        ("[tenants.a\n", "invalid TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_entry(tmp_path, text, message):
    with pytest.raises(TenantsError, match=message):
        load_tenants(write(tmp_path, text))


def test_a_default_table_sets_the_default_tenant():
    tenants = parse_tenants({"tenants": {"default": {"weight": 0.5, "max_concurrency": 3}}})
    assert tenants.default.weight == 0.5 and tenants.default.max_concurrency == 3
    assert len(tenants.tenants) == 1


def test_the_flag_and_the_server_file_load_it_and_its_errors_are_config_errors(tmp_path):
    path = write(tmp_path)
    config = build_config(build_parser().parse_args(["serve", "--model", "/m/a", "--tenants", str(path)]), {})
    assert config.tenants is not None and config.tenants.for_key("sk-chat").name == "chat"
    server = tmp_path / "server.toml"
    server.write_text('tenants = "tenants.toml"\n')  # relative to the server file
    assert load_toml(server)["tenants"].for_key("sk-search").name == "search"
    with pytest.raises(ConfigError, match="cannot read tenants file"):
        build_config(
            build_parser().parse_args(["serve", "--model", "/m/a", "--tenants", str(tmp_path / "no")]), {}
        )
