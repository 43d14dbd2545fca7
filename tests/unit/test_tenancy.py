"""Tenancy without a network: the tenants file, key handling, SLO clamping, rate limits,
sub-applications, and the ASGI gate in front of a stand-in app (issue 30)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from slipstream.contracts.errors import APIError
from slipstream.agent.server.tenancy.config import (
    Limits, load_tenants, parse_tenants, tenancy_line)
from slipstream.agent.server.tenancy.gate import TenancyGate
from slipstream.agent.server.tenancy.identity import caller_of
from slipstream.agent.server.tenancy.keys import (
    KeyProblem, bearer_token, check_key_strength, credential_in_query, key_digest, new_key)
from slipstream.agent.server.tenancy.limits import TenantLimiter
from slipstream.agent.server.tenancy.registry import Tenants
from slipstream.agent.server.tenancy.slo_policy import RequestedSlo, resolve_slo

SEARCH_KEY = "sk-slip-" + "s" * 40
BATCH_KEY = "sk-slip-" + "b" * 40
REVOKED_KEY = "sk-slip-" + "r" * 40


def tenants_yaml(*, search_rpm: int = 600, batch_in_flight: int = 2) -> str:
    return f"""
tenants:
  - name: search
    weight: 2
    api_keys:
      - {{id: prod, sha256: {key_digest(SEARCH_KEY)}}}
      - {{id: old, sha256: {key_digest(REVOKED_KEY)}, revoked: true}}
    slo_classes:
      interactive: {{ttft_s: 0.5, tpot_ms: 50}}
      relaxed: {{ttft_s: 5}}
    default_slo_class: interactive
    limits: {{requests_per_minute: {search_rpm}}}
  - name: batch
    api_keys: [{{id: nightly, sha256: {key_digest(BATCH_KEY)}}}]
    slo_classes: {{bulk: {{ttft_s: 30}}}}
    default_slo_class: bulk
    limits: {{max_in_flight: {batch_in_flight}, tokens_per_minute: 600}}
"""


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml())
    return path


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


# -- the file ---------------------------------------------------------------------------------

def test_a_valid_file_loads_and_the_start_up_line_says_what_is_on(tenants_file):
    tenants = load_tenants(tenants_file).tenants
    assert [t.name for t in tenants] == ["search", "batch"]
    assert tenants[0].tightest_ttft_s == 0.5 and tenants[0].tightest_tpot_ms == 50
    assert tenants[1].tightest_tpot_ms is None
    assert "2 tenants, 3 API keys" in tenancy_line(tenants_file)
    assert "open to any caller" in tenancy_line(None)


@pytest.mark.parametrize("mutation, message", [
    (lambda t: t.replace("name: batch", "name: Batch!"), "DNS label"),
    (lambda t: t.replace("name: batch", "name: search"), "unique"),
    (lambda t: t.replace("default_slo_class: bulk", "default_slo_class: nope"), "not one of"),
    (lambda t: t.replace(key_digest(BATCH_KEY), key_digest(SEARCH_KEY)), "appears twice"),
    (lambda t: t.replace(key_digest(BATCH_KEY), "zz" * 32), "sha256"),
    (lambda t: t.replace("weight: 2", "weight: 0"), "weight"),
    (lambda t: t.replace("{ttft_s: 30}", "{tpot_ms: 30}"), "ttft_s"),
    (lambda t: t + "extra: 1\n", "extra"),
    (lambda t: "tenants: [", "not YAML"),
])
def test_a_file_that_does_not_validate_is_refused_with_the_reason(mutation, message):
    with pytest.raises(ValueError, match=message):
        parse_tenants(mutation(tenants_yaml()))


# -- keys ------------------------------------------------------------------------------------

def test_new_keys_are_random_and_strong_and_stored_as_sha256():
    first, second = new_key(), new_key()
    assert first != second and first.startswith("sk-slip-")
    check_key_strength(first)
    assert key_digest(first) == key_digest(first) and len(key_digest(first)) == 64
    with pytest.raises(ValueError, match="at least 32"):
        check_key_strength("hunter2")


@pytest.mark.parametrize("headers, key", [
    ([(b"authorization", b"Bearer " + SEARCH_KEY.encode())], SEARCH_KEY),
    ([(b"authorization", b"bearer " + SEARCH_KEY.encode())], SEARCH_KEY),  # scheme: any case
    ([(b"Authorization", b"BEARER  " + SEARCH_KEY.encode() + b" ")], SEARCH_KEY),
])
def test_the_bearer_key_is_read_whatever_the_case(headers, key):
    assert bearer_token(headers) == key


@pytest.mark.parametrize("headers, missing", [
    ([], True),
    ([(b"x-api-key", SEARCH_KEY.encode())], True),
    ([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")], False),
    ([(b"authorization", b"Basic dXNlcjpwYXNz")], False),
    ([(b"authorization", b"Bearer")], False),
    ([(b"authorization", b"Bearer " + b"k" * 300)], False),
    ([(b"authorization", "Bearer ключ".encode())], False),
    ([(b"authorization", b"Bearer sk-slip-\"<script>")], False),
])
def test_unreadable_credentials_are_refused(headers, missing):
    with pytest.raises(KeyProblem) as problem:
        bearer_token(headers)
    assert problem.value.missing is missing


def test_credentials_in_the_query_string_are_found():
    assert credential_in_query(b"api_key=sk-slip-x") == "api_key"
    assert credential_in_query(b"a=1&Key=2") == "key"
    assert credential_in_query(b"stream=true") is None


# -- SLO classes -----------------------------------------------------------------------------

def test_slo_names_a_class_or_loosens_but_never_tightens_past_the_tightest_class():
    search = parse_tenants(tenants_yaml()).tenants[0]
    default = resolve_slo(search, None)
    assert (default.class_name, default.ttft_s, default.tpot_ms, default.clamped) == \
        ("interactive", 0.5, 50, ())
    relaxed = resolve_slo(search, RequestedSlo(class_name="relaxed"))
    assert (relaxed.ttft_s, relaxed.tpot_ms) == (5, None)
    looser = resolve_slo(search, RequestedSlo(ttft_s=2.0, tpot_ms=80))
    assert (looser.ttft_s, looser.tpot_ms, looser.clamped) == (2.0, 80, ())
    forged = resolve_slo(search, RequestedSlo(ttft_s=0.001, tpot_ms=1))
    assert (forged.ttft_s, forged.tpot_ms) == (0.5, 50)
    assert forged.clamped == ("ttft_s=0.5", "tpot_ms=50")
    with pytest.raises(APIError) as unknown:
        resolve_slo(search, RequestedSlo(class_name="platinum"))
    assert unknown.value.status_code == 400 and unknown.value.param == "slo.class"


def test_a_tenant_without_a_tpot_class_cannot_set_one():
    batch = parse_tenants(tenants_yaml()).tenants[1]
    resolved = resolve_slo(batch, RequestedSlo(tpot_ms=1))
    assert resolved.tpot_ms is None and resolved.clamped == ("tpot_ms=default",)


# -- limits ----------------------------------------------------------------------------------

def test_requests_per_minute_allow_a_burst_of_a_minute_then_the_rate():
    clock = Clock()
    limiter = TenantLimiter(Limits(requests_per_minute=3), clock)
    for _ in range(3):
        limiter.admit()
        limiter.release()
    with pytest.raises(APIError) as refused:
        limiter.admit()
    error = refused.value
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    assert error.error_type == "requests" and error.headers == {"Retry-After": "20"}
    clock.now_s += 20  # one request's worth refilled
    limiter.admit()


def test_in_flight_and_tokens_per_minute():
    clock = Clock()
    limiter = TenantLimiter(Limits(max_in_flight=1, tokens_per_minute=600), clock)
    limiter.admit()
    with pytest.raises(APIError, match="in flight"):
        limiter.admit()
    limiter.release()
    limiter.admit()
    limiter.charge_tokens(500)
    with pytest.raises(APIError) as refused:
        limiter.charge_tokens(200)
    assert refused.value.error_type == "tokens" and refused.value.headers["Retry-After"] == "10"
    clock.now_s += 60
    limiter.charge_tokens(5000)  # larger than a minute: admitted on a full bucket, in debt
    with pytest.raises(APIError):
        limiter.charge_tokens(1)


# -- the registry: keys to tenants, revocation, reload, sub-applications ---------------------

def test_keys_name_their_tenant_and_app_ids_stay_inside_it(tenants_file):
    tenants = Tenants(tenants_file)
    search = tenants.identify(SEARCH_KEY)
    assert (search.fair_queue_id, search.weight, search.key_id) == ("search", 2.0, "prod")
    assert search.application(None) == "default"
    assert search.application("ranking") == "ranking"
    assert search.application("search/ranking") == "ranking"
    for other in ("batch", "batch/etl"):
        with pytest.raises(APIError) as forbidden:
            search.application(other)
        assert forbidden.value.status_code == 403 and forbidden.value.code == "tenant_mismatch"
    for key, message in ((REVOKED_KEY, "revoked"), ("sk-slip-" + "x" * 40, "Incorrect")):
        with pytest.raises(APIError, match=message) as refused:
            tenants.identify(key)
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_a_changed_file_is_reloaded_and_usage_carries_over(tenants_file):
    clock = Clock()
    tenants = Tenants(tenants_file, clock=clock, check_interval_s=1.0)
    tenants.identify(BATCH_KEY).limiter.admit()  # one of two in flight
    tenants_file.write_text(tenants_yaml(batch_in_flight=1).replace(
        f"{key_digest(SEARCH_KEY)}}}", f"{key_digest(SEARCH_KEY)}, revoked: true}}"))
    clock.now_s += 2
    with pytest.raises(APIError, match="revoked"):
        tenants.identify(SEARCH_KEY)
    with pytest.raises(APIError, match="in flight"):
        tenants.identify(BATCH_KEY).limiter.admit()
    tenants_file.write_text("tenants: [")  # broken: the last good file stays
    clock.now_s += 2
    assert tenants.identify(BATCH_KEY).fair_queue_id == "batch"


# -- the gate, in front of a stand-in app ----------------------------------------------------

def gated_app(tenants: Tenants, seen: list, counted: list) -> TenancyGate:
    async def completions(request: Request) -> JSONResponse:
        caller = caller_of(request.scope)
        assert caller is not None
        seen.append(caller.fair_queue_id)
        body = json.loads(await request.body())
        caller.resolve_slo(RequestedSlo(ttft_s=body.get("ttft_s")))
        return JSONResponse({"tenant": caller.fair_queue_id})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                            Route("/health", lambda request: JSONResponse({"ok": 1}))])
    return TenancyGate(app, tenants, count=lambda label, outcome: counted.append(
        (label, outcome)))


def call(app, path: str = "/v1/completions", headers: dict | None = None,
         body: dict | None = None) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            if path == "/health":
                return await client.get(path)
            return await client.post(path, json=body or {}, headers=headers or {})
    return asyncio.run(go())


def test_the_gate_answers_before_the_app_sees_anything(tenants_file):
    seen: list = []
    counted: list = []
    app = gated_app(Tenants(tenants_file), seen, counted)
    cases = [({}, 401, None), ({"Authorization": "Bearer sk-slip-nope-nope"}, 401,
                               "invalid_api_key"),
             ({"Authorization": f"Bearer {REVOKED_KEY}"}, 401, "invalid_api_key")]
    for headers, status, code in cases:
        answer = call(app, headers=headers)
        assert answer.status_code == status
        error = answer.json()["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    in_url = call(app, path=f"/v1/completions?api_key={SEARCH_KEY}",
                  headers={"Authorization": f"Bearer {SEARCH_KEY}"})
    assert in_url.status_code == 400 and in_url.json()["error"]["param"] == "api_key"
    assert seen == []
    assert call(app, path="/health").status_code == 200  # probes are not gated
    assert counted == [("none", "unauthenticated")] * 3 + [("none", "rejected")]


def test_the_gate_passes_the_caller_and_says_what_it_clamped(tenants_file):
    seen: list = []
    counted: list = []
    app = gated_app(Tenants(tenants_file), seen, counted)
    answer = call(app, headers={"Authorization": f"Bearer {SEARCH_KEY}"},
                  body={"ttft_s": 0.001})
    assert answer.status_code == 200 and answer.json() == {"tenant": "search"}
    assert answer.headers["x-slipstream-slo-clamped"] == "ttft_s=0.5"
    assert answer.headers["x-slipstream-slo-class"] == "interactive"
    assert answer.headers["x-ratelimit-limit-requests"] == "600"
    assert seen == ["search"] and counted == [("search", "ok")]


def test_the_gate_limits_in_flight_and_releases_on_the_way_out(tenants_file):
    seen: list = []
    counted: list = []
    tenants = Tenants(tenants_file)
    app = gated_app(tenants, seen, counted)
    headers = {"Authorization": f"Bearer {BATCH_KEY}"}
    for _ in range(3):  # sequential: each releases its slot
        assert call(app, headers=headers).status_code == 200
    limiter = tenants.identify(BATCH_KEY).limiter
    limiter.admit()
    limiter.admit()  # two held elsewhere: the cap
    refused = call(app, headers=headers)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert counted[-1] == ("batch", "rate_limited") and limiter.in_flight == 2


def test_weighted_virtual_time_serves_a_weight_2_tenant_twice_as_fast():
    from slipstream.agent.scheduler.justitia import VirtualClock

    clock = VirtualClock(capacity_tokens=30)
    heavy = [clock.tag("heavy", 100.0, weight=2.0) for _ in range(3)]
    light = [clock.tag("light", 100.0) for _ in range(3)]
    assert heavy == [50.0, 100.0, 150.0] and light == [100.0, 200.0, 300.0]
    clock.advance(5)  # rate 30 / (2 + 1) = 10 per iteration while both are active
    assert clock.now == 50.0
    with pytest.raises(ValueError):
        clock.tag("x", 1.0, weight=0)


def test_the_router_scopes_the_body_to_the_tenant_or_leaves_odd_ones_to_the_agent(tenants_file):
    from slipstream.agent.router.classify import RoutedRequest
    from slipstream.agent.router.tenants import scoped_body, scoped_request

    caller = Tenants(tenants_file).identify(SEARCH_KEY)
    scoped = json.loads(scoped_body(caller, {"prompt": "x", "app_id": "ranking",
                                             "slo": {"ttft_s": 0.001}}) or b"{}")
    assert scoped["app_id"] == "search/ranking"
    assert scoped["slo"] == {"ttft_s": 0.5, "tpot_ms": 50}  # explicit, within the floor
    for odd in ({"app_id": 5}, {"slo": "fast"}, {"slo": {"ttft_s": True}},
                {"slo": {"deadline": 1}}, {"slo": {"ttft_s": -1}}):
        assert scoped_body(caller, {"prompt": "x", **odd}) is None
    with pytest.raises(APIError) as forbidden:
        scoped_body(caller, {"prompt": "x", "app_id": "batch"})
    assert forbidden.value.status_code == 403
    routed = scoped_request(caller, RoutedRequest("short", 10, "ranking", False, 6, None, 0.0))
    assert (routed.app_id, routed.share_weight) == ("search", 2.0)
