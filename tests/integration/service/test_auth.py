"""API keys guard /v1/*, the admin key guards /admin/*, /health* and /metrics stay open."""

import logging

from service.auth import KeyRing

ADMIN = "/admin/models"  # a real admin route: the registry's listing


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_keyring():
    ring = KeyRing(["alpha", "beta"])
    assert ring.matches("alpha") and ring.matches("beta")
    assert not ring.matches("alph") and not ring.matches("") and not ring.matches("alpha ")
    assert not KeyRing([]) and "alpha" not in repr(ring)


async def test_v1_needs_a_valid_key(start):
    h = await start(api_keys=("k1", "k2"))
    missing = await h.client.get("/v1/models")
    assert missing.status == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert (await missing.json())["error"]["code"] == "invalid_api_key"
    assert (await h.client.get("/v1/models", headers=_bearer("nope"))).status == 401
    assert (await h.client.get("/v1/models", headers={"Authorization": "Basic k1"})).status == 401
    listed = await h.client.get("/v1/models", headers=_bearer("k2"))
    assert [m["id"] for m in (await listed.json())["data"]] == ["primary", "fallback"]
    ok = await h.client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}, headers=_bearer("k1")
    )
    assert ok.status == 200 and (await ok.json())["usage"]["completion_tokens"] == 2


async def test_health_and_metrics_stay_open(start):
    h = await start(api_keys=("k1",))
    for path in ("/health", "/health/live", "/health/ready", "/metrics", "/version"):
        response = await h.client.get(path)
        assert response.status == 200, path
        assert await response.read(), path
    assert (
        'pagedserve:num_requests_running{model_name="primary"}'
        in await (await h.client.get("/metrics")).text()
    )


async def test_metrics_can_require_a_key(start):
    h = await start(api_keys=("k1",), auth_metrics=True)
    assert (await h.client.get("/metrics")).status == 401
    response = await h.client.get("/metrics", headers=_bearer("k1"))
    assert response.status == 200 and "pagedserve:http_requests_total" in await response.text()


async def test_admin_closed_without_an_admin_key(start):
    h = await start(api_keys=("k1",))
    response = await h.client.get(ADMIN, headers=_bearer("k1"))
    assert response.status == 403 and "--admin-key" in (await response.json())["error"]["message"]


async def test_admin_key_is_separate(start):
    h = await start(api_keys=("k1",), admin_key="adm")
    assert (await h.client.get(ADMIN)).status == 401
    assert (await h.client.get(ADMIN, headers=_bearer("k1"))).status == 401
    response = await h.client.get(ADMIN, headers=_bearer("adm"))
    assert response.status == 200
    assert [(m["name"], m["state"]) for m in (await response.json())["models"]] == [
        ("primary", "ready"),
        ("fallback", "ready"),
    ]


async def test_no_keys_means_open_v1(start):
    h = await start()
    response = await h.client.get("/v1/models")
    assert response.status == 200 and [m["id"] for m in (await response.json())["data"]] == [
        "primary",
        "fallback",
    ]


async def test_keys_are_never_logged(start, caplog):
    h = await start(api_keys=("sekrit-key",), admin_key="sekrit-admin")
    with caplog.at_level(logging.DEBUG):
        await h.client.get("/v1/models", headers=_bearer("sekrit-wrong"))
        await h.client.post("/v1/completions", json={"prompt": "hi"}, headers=_bearer("sekrit-key"))
        await h.client.get(ADMIN, headers=_bearer("sekrit-admin"))
    assert caplog.records and not any("sekrit" in r.getMessage() for r in caplog.records)
