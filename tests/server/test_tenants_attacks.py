"""Attacks on tenancy against a real ``slipstream serve`` (tenants file and control token on)
and a real ``slipstream router`` in front of it, with the same tenants file (issue 30).

Every case gets its documented status (docs/tenancy.md, "What a refused request gets"), in
OpenAI's error shape, from the router and from the agent directly; a refused request never
reaches the engine (the agent's finished-request and prompt-token counters stand still);
``SetPool`` without or with a wrong token changes nothing."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from slipstream.contracts.control import ControlClient
from slipstream.agent.server.tenancy.keys import key_digest, new_key

pytestmark = pytest.mark.timeout(600)

MODEL = "tiny-test"
ALPHA, BETA, REVOKED, BURST, DIRECT_BURST = (new_key() for _ in range(5))
CONTROL_TOKEN = "c" * 48
BURST_LIMIT = 4
FINISHED = "slipstream_requests_total"
PROMPT_TOKENS = "slipstream_prompt_tokens_total"


def tenants_yaml() -> str:
    def key(name: str, value: str, revoked: bool = False) -> str:
        return f"{{id: {name}, sha256: {key_digest(value)}{', revoked: true' if revoked else ''}}}"
    classes = "{interactive: {ttft_s: 0.5, tpot_ms: 50}, batch: {ttft_s: 30}}"
    return f"""
tenants:
  - name: alpha
    api_keys: [{key('a', ALPHA)}, {key('old', REVOKED, revoked=True)}]
    slo_classes: {classes}
    default_slo_class: batch
  - name: beta
    weight: 2
    api_keys: [{key('b', BETA)}]
    slo_classes: {classes}
    default_slo_class: interactive
  - name: burst
    api_keys: [{key('x', BURST)}]
    slo_classes: {classes}
    default_slo_class: batch
    limits: {{requests_per_minute: {BURST_LIMIT}}}
  - name: direct
    api_keys: [{key('y', DIRECT_BURST)}]
    slo_classes: {classes}
    default_slo_class: batch
    limits: {{requests_per_minute: {BURST_LIMIT}}}
"""


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tenancy")
    (directory / "tenants.yaml").write_text(tenants_yaml())
    (directory / "control-token").write_text(CONTROL_TOKEN)
    return directory


@pytest.fixture(scope="module")
def agent(start_server, secrets_dir):
    return start_server("--tenants", str(secrets_dir / "tenants.yaml"),
                        "--control-token-file", str(secrets_dir / "control-token"))


@pytest.fixture(scope="module")
def router(run_router, tiny_model_dir, tmp_path_factory, agent, secrets_dir):
    with run_router(tiny_model_dir, tmp_path_factory.mktemp("router-tenants"),
                    [f"{agent.base_url}=short"],
                    "--tenants", str(secrets_dir / "tenants.yaml")) as handle:
        yield handle


@pytest.fixture(params=["router", "agent"])
def front(request, router, agent) -> str:
    return router.base_url if request.param == "router" else agent.base_url


def body(**extra) -> dict:
    return {"model": MODEL, "prompt": "hello tenants", "max_tokens": 2, **extra}


def post(base_url: str, headers: dict | list | None = None, payload: dict | None = None,
         path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=payload or body(), headers=headers,
                      timeout=60)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def engine_counts(agent) -> tuple[float, float]:
    text = httpx.get(f"{agent.base_url}/metrics", timeout=10).text
    finished = prompt = 0.0
    for line in text.splitlines():
        if line.startswith(FINISHED + "{"):
            finished += float(line.rsplit(" ", 1)[1])
        elif line.startswith(PROMPT_TOKENS + " "):
            prompt = float(line.rsplit(" ", 1)[1])
    return finished, prompt


def assert_openai_error(answer: httpx.Response, status: int, code: str | None) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert "Traceback" not in error["message"] and "sk-slip-" not in error["message"]
    return error


REFUSED = [
    ("missing", {}, 401, None),
    ("wrong", bearer("sk-slip-" + "w" * 43), 401, "invalid_api_key"),
    ("revoked", bearer(REVOKED), 401, "invalid_api_key"),
    ("basic scheme", {"Authorization": "Basic YWxwaGE6cGFzcw=="}, 401, "invalid_api_key"),
    ("empty bearer", {"Authorization": "Bearer"}, 401, "invalid_api_key"),
    ("two words", {"Authorization": f"Bearer {ALPHA} extra"}, 401, "invalid_api_key"),
    ("quotes", {"Authorization": f'Bearer "{ALPHA}"'}, 401, "invalid_api_key"),
    ("long key", bearer("sk-slip-" + "k" * 600), 401, "invalid_api_key"),
    ("x-api-key only", {"x-api-key": ALPHA}, 401, None),
    ("key as prefix", bearer(ALPHA[:-1]), 401, "invalid_api_key"),
    ("other's key with alpha's suffix", bearer(BETA + "x"), 401, "invalid_api_key"),
]


@pytest.mark.parametrize("case, headers, status, code", REFUSED, ids=[c[0] for c in REFUSED])
def test_bad_keys_are_refused_before_the_engine(front, agent, case, headers, status, code):
    before = engine_counts(agent)
    error = assert_openai_error(post(front, headers), status, code)
    assert error["type"] == "invalid_request_error"
    assert engine_counts(agent) == before


def test_a_key_in_the_query_string_is_refused_even_with_a_good_header(front, agent):
    before = engine_counts(agent)
    for query in (f"?api_key={ALPHA}", f"?key={ALPHA}", f"?access_token={ALPHA}"):
        answer = httpx.post(f"{front}/v1/completions{query}", json=body(),
                            headers=bearer(ALPHA), timeout=60)
        assert_openai_error(answer, 400, None)
    assert engine_counts(agent) == before


def test_header_name_and_scheme_case_do_not_matter(front):
    for name, scheme in (("authorization", "Bearer"), ("AUTHORIZATION", "bearer"),
                         ("Authorization", "BEARER")):
        answer = post(front, {name: f"{scheme} {ALPHA}"})
        assert answer.status_code == 200, answer.text


def test_duplicate_authorization_headers_are_refused(front, agent):
    """Even two copies of a good key: which one counts is never guessed."""
    before = engine_counts(agent)
    for pair in ((ALPHA, ALPHA), (ALPHA, BETA), (ALPHA, "sk-slip-" + "w" * 43)):
        answer = post(front, [("Authorization", f"Bearer {pair[0]}"),
                              ("Authorization", f"Bearer {pair[1]}")])
        assert_openai_error(answer, 401, "invalid_api_key")
    assert engine_counts(agent) == before


def test_oversized_headers_are_refused(front, agent):
    """A header block past 32 KiB gets a 431 in OpenAI's shape before anything else is
    looked at; the server serves on."""
    before = engine_counts(agent)
    host, port = front.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Authorization", f"Bearer {ALPHA}")
        connection.putheader("X-Padding", "p" * 70_000)
        connection.putheader("Content-Type", "application/json")
        payload = json.dumps(body()).encode()
        connection.putheader("Content-Length", str(len(payload)))
        connection.endheaders(payload)
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 431
    assert answer["error"]["code"] == "request_header_fields_too_large"
    assert engine_counts(agent) == before
    assert post(front, bearer(ALPHA)).status_code == 200


@pytest.mark.parametrize("app_id", ["beta", "beta/search", "burst"])
def test_another_tenants_app_id_is_forbidden(front, agent, app_id):
    before = engine_counts(agent)
    error = assert_openai_error(post(front, bearer(ALPHA), body(app_id=app_id)), 403,
                                "tenant_mismatch")
    assert error["param"] == "app_id"
    assert engine_counts(agent) == before


def test_an_app_id_inside_the_own_tenant_is_served(front):
    for app_id in ("search", "alpha/search"):
        assert post(front, bearer(ALPHA), body(app_id=app_id)).status_code == 200


def test_a_forged_tight_slo_is_clamped_to_the_tenants_tightest_class(front):
    answer = post(front, bearer(ALPHA), body(slo={"ttft_s": 0.001, "tpot_ms": 0.01}))
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-slipstream-slo-clamped"] == "ttft_s=0.5; tpot_ms=50"
    named = post(front, bearer(ALPHA), body(slo={"class": "interactive"}))
    assert named.status_code == 200 and "x-slipstream-slo-clamped" not in named.headers
    assert named.headers["x-slipstream-slo-class"] == "interactive"
    default = post(front, bearer(ALPHA))
    assert default.headers["x-slipstream-slo-class"] == "batch"
    unknown = post(front, bearer(ALPHA), body(slo={"class": "platinum"}))
    assert_openai_error(unknown, 400, None)


def test_the_agent_counts_clamped_slos_per_tenant(agent):
    before = agent.metric("slipstream_tenant_slo_clamped_total", tenant="alpha")
    post(agent.base_url, bearer(ALPHA), body(slo={"ttft_s": 0.0001}))
    assert agent.metric("slipstream_tenant_slo_clamped_total", tenant="alpha") == before + 1
    assert agent.metric("slipstream_tenant_requests_total", tenant="none",
                        outcome="unauthenticated") >= 1


def test_a_burst_over_the_limit_gets_429_with_retry_after(router, agent):
    """Through the router: the router's own limiter answers; the agent enforces the same
    limit again for a client that goes to it directly."""
    for base_url, key in ((router.base_url, BURST), (agent.base_url, DIRECT_BURST)):
        statuses = []
        for _ in range(BURST_LIMIT + 3):
            answer = post(base_url, bearer(key))
            statuses.append(answer.status_code)
        assert statuses == [200] * BURST_LIMIT + [429] * 3, (base_url, statuses)
        error = assert_openai_error(answer, 429, "rate_limit_exceeded")
        assert error["type"] == "requests"
        assert 1 <= int(answer.headers["retry-after"]) <= 60
    # The router's refusals never reached the agent: it saw BURST_LIMIT of the burst tenant.
    assert agent.metric("slipstream_tenant_requests_total", tenant="burst",
                        outcome="ok") == BURST_LIMIT


def test_the_openai_client_sends_its_key_as_the_gate_wants(router):
    good = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key=BETA, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.PermissionDeniedError):
        good.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                extra_body={"app_id": "alpha"})


@pytest.mark.parametrize("token", [None, "wrong-" + "x" * 40, CONTROL_TOKEN + "x"])
def test_set_pool_without_the_control_token_is_refused(agent, token):
    with ControlClient(agent.control_target, timeout_s=10, token=token) as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.set_pool("long")
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with ControlClient(agent.control_target, timeout_s=10, token=CONTROL_TOKEN) as client:
        assert client.stats().pool == "short"  # unchanged


def test_set_pool_with_the_control_token_works(agent):
    with ControlClient(agent.control_target, timeout_s=10, token=CONTROL_TOKEN) as client:
        assert client.set_pool("long").previous_pool == "short"
        assert client.set_pool("short").previous_pool == "long"
