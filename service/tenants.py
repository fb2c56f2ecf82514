"""`--tenants FILE`: which API key belongs to which tenant, and each tenant's weight, band and quota.

    [fairness]                  # optional: what the scheduler's virtual token counter charges
    prefill_cost = 1.0          #   per prompt token computed
    decode_cost = 2.0           #   per generated token
    contended_prefill_tokens = 128  # a prompt chunk while two tenants or more have work (whole: up to 2x)

    [tenants.default]           # optional: requests whose key names no tenant (or that carry none)
    weight = 1.0

    [tenants.search]
    keys = ["sk-search-1", "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
    weight = 2.0                # twice the tokens of a weight-1 tenant of its band, when both want more
    priority = 0                # its band (lower first); a request may ask for a less important one
    tokens_per_minute = 60000   # prompt + generated tokens; over it: 429 with Retry-After
    burst = 8000                # the bucket's size (default: one minute's tokens)
    max_concurrency = 16        # requests in flight; over it: 429

A key is given as itself or as `sha256:<hex digest>` (the file need not hold secrets). Every tenant key is
an API key: with any, /v1/* needs a key (--api-key keys stay valid and serve the default tenant)."""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.fair_share import FairShare
from resilience.tenants import Tenant

DEFAULT_TENANT = "default"
TENANT_OPTIONS = ("keys", "weight", "priority", "tokens_per_minute", "burst", "max_concurrency")
FAIRNESS_OPTIONS = ("prefill_cost", "decode_cost", "contended_prefill_tokens")
_DIGEST = re.compile(r"^sha256:([0-9a-fA-F]{64})$")


class TenantsError(ValueError):
    """A tenants file that cannot be served; the message names the file and the entry."""


@dataclass(frozen=True)
class Tenants:
    tenants: tuple[Tenant, ...]  # the default one included
    key_digests: dict[bytes, str] = field(repr=False)  # sha256 of a key -> its tenant's name
    fairness: FairShare = FairShare(DEFAULT_TENANT)  # [fairness]: every tenant's share but name and weight

    @property
    def default(self) -> Tenant:
        return next(t for t in self.tenants if t.name == DEFAULT_TENANT)

    def for_key(self, key: str | None) -> Tenant:
        """The tenant a bearer key belongs to (the default one: no key, or a key of no tenant)."""
        name = self.key_digests.get(key_digest(key)) if key is not None else None
        return next(t for t in self.tenants if t.name == name) if name else self.default

    def share(self, tenant: Tenant) -> FairShare:
        return replace(self.fairness, tenant=tenant.name, weight=tenant.weight)


def usable_key(key: object) -> bool:
    """A key a Bearer token can match: a non-empty printable string without whitespace."""
    return isinstance(key, str) and key != "" and key.isprintable() and not any(c.isspace() for c in key)


def key_digest(key: str) -> bytes:
    """How a key is kept and compared (service/auth.py): its sha256."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def load_tenants(path: str | Path) -> Tenants:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise TenantsError(f"cannot read tenants file {str(path)!r}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TenantsError(f"{path}: invalid TOML: {exc}") from exc
    return parse_tenants(data, str(path))


def parse_tenants(data: dict[str, Any], where: str = "tenants") -> Tenants:
    unknown = sorted(set(data) - {"fairness", "tenants"})
    _check(not unknown, f"{where}: unknown tables {unknown}; known: ['fairness', 'tenants']")
    fairness = data.get("fairness", {})
    _check(isinstance(fairness, dict), f"{where}: [fairness] must be a table")
    unknown = sorted(set(fairness) - set(FAIRNESS_OPTIONS))
    _check(not unknown, f"{where}: [fairness] unknown keys {unknown}; known: {list(FAIRNESS_OPTIONS)}")
    tables = data.get("tenants", {})
    _check(isinstance(tables, dict) and tables, f"{where}: no tenant: add a [tenants.<name>] table")
    tenants, digests = [], {}
    for name, table in tables.items():
        entry = f"{where}: [tenants.{name}]"
        _check(isinstance(table, dict), f"{entry} must be a table")
        unknown = sorted(set(table) - set(TENANT_OPTIONS))
        _check(not unknown, f"{entry}: unknown keys {unknown}; known: {list(TENANT_OPTIONS)}")
        keys = table.get("keys", [])
        _check(
            isinstance(keys, list) and all(isinstance(k, str) for k in keys), f"{entry}: keys must be strings"
        )
        _check(not (name == DEFAULT_TENANT and keys), f"{entry}: the default tenant has no keys of its own")
        for key in keys:
            digest = _digest_of(key, entry)
            _check(digest not in digests, f"{entry}: a key is also {digests.get(digest)!r}'s")
            digests[digest] = name
        try:
            tenants.append(Tenant(name, **{k: v for k, v in table.items() if k != "keys"}))
        except (TypeError, ValueError) as exc:
            raise TenantsError(f"{entry}: {exc}") from None
    if DEFAULT_TENANT not in tables:
        tenants.append(Tenant(DEFAULT_TENANT))
    try:
        share = FairShare(DEFAULT_TENANT, **fairness)
    except (TypeError, ValueError) as exc:
        raise TenantsError(f"{where}: [fairness]: {exc}") from None
    return Tenants(tuple(tenants), digests, share)


def _digest_of(key: str, entry: str) -> bytes:
    match = _DIGEST.match(key)
    if match:
        return bytes.fromhex(match.group(1))
    _check(
        usable_key(key),
        f"{entry}: a key is empty or holds whitespace or a control character: no Bearer token could match it",
    )
    return key_digest(key)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise TenantsError(message)
