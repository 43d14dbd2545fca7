"""The router's decisions without a network: prompt length with the model's tokenizer, pool
membership from pod watch events (relabelling included), least predicted backlog, and the
Justitia fair queue once every instance is saturated."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slipstream.agent.engine.models.tiny_model import PRESETS, build_tokenizer, tokenizer_config
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.router.classify import CHAT, COMPLETIONS, LengthClassifier
from slipstream.agent.router.config import (
    KubernetesDiscovery, RouterConfig, StaticBackend)
from slipstream.agent.router.dispatcher import Dispatcher, NoInstanceError
from slipstream.agent.router.instances import AgentReport, BackendSpec, InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.pod_discovery import apply_pod_event, backend_from_pod
from slipstream.agent.router.stats_poller import parse_agent_metrics
from slipstream.contracts import metric_names

THRESHOLD_TOKENS = 64
DISCOVERY = KubernetesDiscovery(namespace="serving")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    """The tiny model's tokenizer files only (no weights, no torch)."""
    model_dir: Path = tmp_path_factory.mktemp("tokenizer")
    backend = build_tokenizer(PRESETS["tiny"].vocab_size)
    backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(PRESETS["tiny"], backend)))
    return Tokenizer.from_dir(model_dir)


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_config(**overrides) -> RouterConfig:
    settings = dict(long_prefill_threshold_tokens=THRESHOLD_TOKENS,
                    static_backends=(StaticBackend("http://127.0.0.1:1", "short"),))
    settings.update(overrides)
    return RouterConfig(**settings)


def make_dispatcher(table: InstanceTable, clock=None, **overrides) -> Dispatcher:
    return Dispatcher(table, make_config(**overrides), RouterMetrics(), clock=clock or ManualClock())


def spec(name: str, pool: str) -> BackendSpec:
    return BackendSpec(name=name, url=f"http://127.0.0.1:{9000 + len(name)}", pool=pool,
                       instance=name)


def pod(name: str, pool: str, ip: str = "127.1.0.2", ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {"slipstream.dev/pool": pool,
                                                 "slipstream.dev/instance": f"{name}-instance",
                                                 "slipstream.dev/role": "controller"}},
            "spec": {"containers": [{"name": "agent", "ports": [
                {"name": "grpc-control", "containerPort": 50051},
                {"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": ip, "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def classify(classifier: LengthClassifier, endpoint: str, body: dict):
    return classifier.classify(endpoint, body, now_s=0.0)


# -- classification ---------------------------------------------------------------------------

def test_completion_prompts_are_counted_with_the_model_tokenizer(tokenizer):
    classifier = LengthClassifier(tokenizer, THRESHOLD_TOKENS)
    short_text = "hello world"
    long_text = "the quick brown fox jumps over the lazy dog " * 20
    short = classify(classifier, COMPLETIONS, {"prompt": short_text})
    long = classify(classifier, COMPLETIONS, {"prompt": [long_text]})  # a batch of one
    assert short.prompt_tokens == len(tokenizer.encode(short_text)) < THRESHOLD_TOKENS
    assert short.request_class == "short"
    assert long.prompt_tokens == len(tokenizer.encode(long_text)) >= THRESHOLD_TOKENS
    assert long.request_class == "long"


def test_token_id_prompts_and_the_threshold_boundary():
    classifier = LengthClassifier(None, THRESHOLD_TOKENS)
    below = classify(classifier, COMPLETIONS, {"prompt": list(range(THRESHOLD_TOKENS - 1))})
    at = classify(classifier, COMPLETIONS, {"prompt": list(range(THRESHOLD_TOKENS))})
    assert (below.request_class, at.request_class) == ("short", "long")


def test_chat_is_counted_through_the_chat_template(tokenizer):
    classifier = LengthClassifier(tokenizer, THRESHOLD_TOKENS)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                             {"type": "text", "text": "there"}]}]
    routed = classify(classifier, CHAT, {"messages": messages, "app_id": "search",
                                         "stream": True, "max_completion_tokens": 7,
                                         "slo": {"ttft_s": 2.5}})
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert routed.prompt_tokens == len(tokenizer.encode_chat(plain))
    # The template adds role headers, so the conversation is longer than its text.
    assert routed.prompt_tokens > len(tokenizer.encode("be brief hi there"))
    assert (routed.app_id, routed.stream, routed.max_tokens) == ("search", True, 7)
    assert routed.ttft_deadline_s == pytest.approx(2.5)


def test_unreadable_bodies_go_short_for_the_agent_to_reject():
    classifier = LengthClassifier(None, THRESHOLD_TOKENS)
    routed = classifier.classify(CHAT, None)
    assert (routed.request_class, routed.prompt_tokens, routed.app_id) == ("short", 0, "default")


# -- membership -------------------------------------------------------------------------------

def test_pods_become_backends_from_pod_ip_and_the_http_port():
    backend = backend_from_pod(pod("chat-0-abcde-0", "long"), DISCOVERY)
    assert backend == BackendSpec(name="chat-0-abcde-0", url="http://127.1.0.2:8000",
                                  pool="long", instance="chat-0-abcde-0-instance")
    assert backend_from_pod(pod("p", "short", ready=False), DISCOVERY) is None
    deleting = pod("p", "short")
    deleting["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    assert backend_from_pod(deleting, DISCOVERY) is None
    unscheduled = pod("p", "short")
    del unscheduled["status"]["podIP"]
    assert backend_from_pod(unscheduled, DISCOVERY) is None


def test_relabelling_moves_an_instance_between_pools_in_one_watch_event():
    table = InstanceTable()
    dispatcher = make_dispatcher(table)
    apply_pod_event(table, "ADDED", pod("a", "short", ip="127.1.0.2"), DISCOVERY)
    apply_pod_event(table, "ADDED", pod("b", "long", ip="127.1.0.3"), DISCOVERY)
    classifier = LengthClassifier(None, THRESHOLD_TOKENS)
    long_request = classify(classifier, COMPLETIONS, {"prompt": list(range(THRESHOLD_TOKENS))})

    def long_pool_names() -> set[str]:
        return {i.name for i in table.candidates("long")}

    assert long_pool_names() == {"b"}
    apply_pod_event(table, "MODIFIED", pod("a", "long", ip="127.1.0.2"), DISCOVERY)
    assert long_pool_names() == {"a", "b"}
    apply_pod_event(table, "MODIFIED", pod("b", "short", ip="127.1.0.3"), DISCOVERY)
    assert long_pool_names() == {"a"}
    lease = asyncio.run(dispatcher.acquire(long_request, finish_tag=0.0))
    assert lease.instance.name == "a"
    lease.finish()
    apply_pod_event(table, "MODIFIED", pod("a", "long", ready=False), DISCOVERY)
    apply_pod_event(table, "DELETED", pod("b", "short"), DISCOVERY)
    assert len(table) == 0


def test_an_empty_pool_falls_back_to_the_other_and_unified_serves_both():
    table = InstanceTable()
    table.upsert(spec("s", "short"))
    assert [i.name for i in table.candidates("long")] == ["s"]  # better than refusing
    table.upsert(spec("u", "unified"))
    assert [i.name for i in table.candidates("long")] == ["u"]
    assert {i.name for i in table.candidates("short")} == {"s", "u"}


# -- least predicted backlog ------------------------------------------------------------------

def test_requests_go_to_the_instance_with_the_least_predicted_backlog():
    table = InstanceTable()
    for name in ("a", "b", "c"):
        table.upsert(spec(name, "short"))
    # FIFO instances: a new request waits behind all of an instance's backlog (shorter-first
    # ones are in test_router_prefix_affinity.py).
    dispatcher = make_dispatcher(table, instance_queue_order="fifo")
    classifier = LengthClassifier(None, THRESHOLD_TOKENS)
    big = classify(classifier, COMPLETIONS, {"prompt": list(range(50))})
    small = classify(classifier, COMPLETIONS, {"prompt": list(range(5))})

    async def scenario():
        first = await dispatcher.acquire(big, 0.0)
        second = await dispatcher.acquire(small, 0.0)
        third = await dispatcher.acquire(small, 0.0)
        # a: 50 pending tokens, two others 5 each: the next goes to one of the 5s, and a
        # foreign report (another router's 4 decodes) makes that one the more loaded.
        table.get(second.instance.name).report(AgentReport(prefill_requests=1,
                                                           decode_requests=4,
                                                           kv_capacity_tokens=None))
        fourth = await dispatcher.acquire(small, 0.0)
        return first, second, third, fourth

    first, second, third, fourth = asyncio.run(scenario())
    assert len({first.instance.name, second.instance.name, third.instance.name}) == 3
    assert fourth.instance.name == third.instance.name
    assert first.instance.own_prefill_tokens == 50


def test_stats_come_from_the_agents_prometheus_gauges():
    in_flight, capacity = metric_names.REQUESTS_IN_FLIGHT.name, metric_names.KV_BLOCKS_CAPACITY.name
    text = (f"# TYPE {in_flight} gauge\n"
            f'{in_flight}{{request_class="short",pool="short",phase="prefill"}} 3\n'
            f'{in_flight}{{request_class="long",pool="short",phase="prefill"}} 1\n'
            f'{in_flight}{{request_class="short",pool="short",phase="decode"}} 7\n'
            f"# TYPE {capacity} gauge\n{capacity} 512\n")
    assert parse_agent_metrics(text) == AgentReport(prefill_requests=4, decode_requests=7,
                                                    kv_capacity_tokens=512 * 16)


# -- saturation and fairness ------------------------------------------------------------------

def test_under_saturation_two_applications_alternate_instead_of_first_come_first_served():
    """One instance, one slot. App "flood" queues six requests, then "light" queues three of
    the same size: FIFO would serve light last; Justitia's tags interleave the two."""
    classifier = LengthClassifier(None, THRESHOLD_TOKENS)

    def request(app_id: str, prompt_tokens: int = 20):
        return classifier.classify(COMPLETIONS, {"prompt": list(range(prompt_tokens)),
                                                 "app_id": app_id, "max_tokens": 16}, now_s=0.0)

    async def scenario(light_prompt_tokens: int) -> list[str]:
        table = InstanceTable()
        table.upsert(spec("only", "short"))
        dispatcher = make_dispatcher(table, max_in_flight_per_instance=1)
        order: list[str] = []
        first = request("flood")
        holder = await dispatcher.acquire(first, dispatcher.tag(first))

        async def client(app_id: str, prompt_tokens: int = 20) -> None:
            routed = request(app_id, prompt_tokens)
            lease = await dispatcher.acquire(routed, dispatcher.tag(routed))
            order.append(app_id)
            await asyncio.sleep(0)
            lease.finish(output_tokens=16)

        tasks = [asyncio.create_task(client("flood")) for _ in range(6)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(client("light", light_prompt_tokens)) for _ in range(3)]
        await asyncio.sleep(0)
        assert dispatcher.queue_depth("short") == 9
        holder.finish(output_tokens=16)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario(light_prompt_tokens=20))
    assert [i for i, app in enumerate(order) if app == "light"] == [1, 3, 5], order
    # A cheaper request (less KV token-time) finishes earlier in GPS, so it goes first.
    order = asyncio.run(scenario(light_prompt_tokens=4))
    assert order[0] == "light", order


def test_a_retry_skips_the_instances_it_tried_and_fails_when_none_are_left():
    table = InstanceTable()
    table.upsert(spec("a", "short"))
    table.upsert(spec("b", "short"))
    dispatcher = make_dispatcher(table)
    routed = LengthClassifier(None, THRESHOLD_TOKENS).classify(COMPLETIONS, {"prompt": [1]})

    async def scenario():
        lease = await dispatcher.acquire(routed, 0.0, exclude=frozenset({"a"}))
        lease.finish()
        with pytest.raises(NoInstanceError):
            await dispatcher.acquire(routed, 0.0, exclude=frozenset({"a", "b"}))
        return lease.instance.name

    assert asyncio.run(scenario()) == "b"


def test_a_full_queue_times_out_with_no_instance_error():
    table = InstanceTable()
    table.upsert(spec("a", "short"))
    dispatcher = make_dispatcher(table, max_in_flight_per_instance=1, queue_timeout_s=0.05)
    routed = LengthClassifier(None, THRESHOLD_TOKENS).classify(COMPLETIONS, {"prompt": [1]})

    async def scenario():
        holder = await dispatcher.acquire(routed, 0.0)
        with pytest.raises(NoInstanceError, match="saturated"):
            await dispatcher.acquire(routed, 1.0)
        assert dispatcher.queue_depth("short") == 0
        holder.finish()
        return table.get("a").own_in_flight

    assert asyncio.run(scenario()) == 0
