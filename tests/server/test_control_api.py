"""The gRPC control API of a real ``slipstream serve`` process: what the operator reads."""

from __future__ import annotations

import threading

import grpc
import pytest

from slipstream.contracts.control import ControlClient


def test_health_names_the_served_model(server):
    with ControlClient(server.control_target) as client:
        health = client.health()
    assert health.healthy
    assert health.model == server.model


def test_stats_report_kv_cache_and_busy_time_after_requests(server):
    client_http = server.openai_client()
    with ControlClient(server.control_target) as client:
        before = client.stats()
        # Keep the engine busy from a thread while sampling the stats.
        worker = threading.Thread(target=lambda: [client_http.completions.create(
            model=server.model, prompt="hello " * 200, max_tokens=32) for _ in range(3)])
        worker.start()
        worker.join(timeout=120)
        after = client.stats()
    assert before.kv_blocks_total == after.kv_blocks_total > 0
    assert after.utilization > 0.0, "steps ran, so the engine was busy part of the window"
    assert after.prefill_tokens_per_second > 0.0
    assert after.num_waiting == 0 and after.num_running == 0
    assert after.pool == "short"  # from $SLIPSTREAM_POOL


def test_set_pool_relabels_new_requests_and_rejects_unknown_pools(server):
    with ControlClient(server.control_target) as client:
        answer = client.set_pool("long")
        try:
            assert answer.previous_pool == "short" and answer.pool == "long"
            assert client.stats().pool == "long"
            server.openai_client().completions.create(model=server.model, prompt="x",
                                                       max_tokens=2)
            assert server.metric("slipstream_e2e_request_latency_seconds_count",
                                 pool="long") >= 1
            assert server.metric("slipstream_pool_role_info", pool="long") == 1
            assert server.metric("slipstream_pool_role_info", pool="short") == 0, \
                "the old role's series is gone"
            with pytest.raises(grpc.RpcError) as caught:
                client.set_pool("medium")
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "medium" in caught.value.details()
        finally:
            client.set_pool("short")  # the session's other tests expect the original label
