"""Schemathesis fuzzes a real server from its own OpenAPI document (/openapi.json, which
describes both request bodies): a bounded number of generated requests per operation, valid
and invalid, and not one may get a 5xx. The server is healthy afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.timeout(900)

EXAMPLES_PER_OPERATION = 40


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(server, mode):
    document = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in document["paths"][path]["post"], path
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    calls = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a GET without parameters has no invalid form

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            calls.append(case.method)
            case.call_and_validate(base_url=server.base_url, checks=[not_a_server_error],
                                   timeout=120)

        fuzz()
    print(f"\n{mode.value}: {len(calls)} generated requests, no 5xx")
    assert len(calls) >= EXAMPLES_PER_OPERATION


def test_the_server_is_healthy_after_the_fuzzing(server):
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
