"""`--api-key` is kept as a salted SHA-256 (folio/server/auth.py), and under `--replicas` only that digest
reaches the ingress: Ray shows a deployment's arguments in its dashboard and state API."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import cloudpickle
import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from folio.engine_args import EngineArgs
from folio.server.auth import APIKeyDigest, APIKeyMiddleware
from folio.server.serve import ServerOptions

KEY = "sk-folio-digest-test-7f3a9c"


def test_digest_matches_only_its_key():
    digest = APIKeyDigest.of(KEY)
    assert len(digest.salt) == 16 and digest.sha256 == hashlib.sha256(digest.salt + KEY.encode()).digest()
    assert digest.matches(KEY.encode())
    for wrong in (b"", KEY.encode()[:-1], KEY.encode() + b"x", KEY.upper().encode(), f"Bearer {KEY}".encode()):
        assert not digest.matches(wrong)
    again = APIKeyDigest.of(KEY)
    assert again.salt != digest.salt and again.sha256 != digest.sha256  # a fresh salt each time
    assert KEY not in repr(digest) and digest.sha256.hex() not in repr(digest)
    with pytest.raises(ValueError, match="empty"):
        APIKeyDigest.of("  ")


async def _hello(request):
    return PlainTextResponse("hello")


def _guarded(api_key: str | APIKeyDigest) -> httpx.AsyncClient:
    app = Starlette(routes=[Route("/v1/models", _hello), Route("/health", _hello), Route("/v1/messages", _hello)])
    guarded = APIKeyMiddleware(app, api_key=api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://folio")


@pytest.mark.parametrize("given", ["digest", "key"])
def test_middleware_checks_both_headers_by_digest(given):
    asyncio.run(_check_middleware(APIKeyDigest.of(KEY) if given == "digest" else KEY))


async def _check_middleware(api_key: str | APIKeyDigest) -> None:
    async with _guarded(api_key) as client:
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).text == "hello"
        assert (await client.get("/v1/messages", headers={"x-api-key": KEY})).text == "hello"
        assert (await client.get("/health")).status_code == 200  # open without a key
        wrong = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "incorrect API key"
        assert wrong.json()["error"]["code"] == "invalid_api_key" and wrong.headers["www-authenticate"] == "Bearer"
        for headers in ({"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}, {"x-api-key": KEY[:-1]}):
            assert (await client.get("/v1/models", headers=headers)).status_code == 401
        missing = await client.get("/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["message"].startswith("missing API key")
        anthropic = await client.post("/v1/messages", headers={"x-api-key": "wrong"})
        assert anthropic.status_code == 401 and anthropic.json()["error"]["type"] == "authentication_error"


def _strings(value: object, seen: set[int] | None = None) -> list[str]:
    """Every string inside `value`: containers, dataclasses and objects' attributes, nested Applications."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, bytes | int | float | bool | type(None)):
        return []
    seen.add(id(value))
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.items() for s in _strings(item, seen)]
    if isinstance(value, list | tuple | set | frozenset):
        return [s for item in value for s in _strings(item, seen)]
    if dataclasses.is_dataclass(value):
        return [s for f in dataclasses.fields(value) for s in _strings(getattr(value, f.name), seen)]
    bound = getattr(value, "_bound_deployment", None)  # a nested Application: its deployment's arguments
    if bound is not None:
        return _strings((bound.init_args, bound.init_kwargs), seen)
    return _strings(vars(value), seen) if hasattr(value, "__dict__") else []


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Serve's own pydantic deprecations, on import
def test_application_binds_a_digest_never_the_key():
    """What `build_application` binds, and what Ray Serve pickles for its controller, hold no API key."""
    from ray.serve._private.build_app import build_app  # what serve.run does with the application

    from folio.scale_out.deploy import build_application
    from folio.scale_out.options import ReplicaOptions

    server = ServerOptions(api_key=KEY, max_queue=7)
    app = build_application(EngineArgs(), "m", server, ReplicaOptions(replicas=2, cpus_per_replica=1))
    bound = app._bound_deployment
    args = (bound.init_args, bound.init_kwargs)
    assert not [s for s in _strings(args) if KEY in s]
    assert KEY.encode() not in cloudpickle.dumps(args)
    for deployment in build_app(app, name="folio").deployments:
        config = deployment._replica_config
        for pickled in (config.serialized_init_args, config.serialized_init_kwargs):
            assert KEY.encode() not in (pickled or b""), deployment.name
    digests = [a for a in bound.init_args if isinstance(a, APIKeyDigest)]
    assert len(digests) == 1 and digests[0].matches(KEY.encode())
    options = next(a for a in bound.init_args if isinstance(a, ServerOptions))
    assert options.api_key is None and options.max_queue == 7  # the rest of the options travel as they were
    assert server.api_key == KEY  # the caller's options are left alone (serve_on_ray logs "API key required")
