"""Readiness and load reports from the agents, polled over HTTP.

    every stats_interval_s: GET <agent>/health --> ready? (no: mark_failed, no traffic)
                            GET <agent>/metrics --parse_agent_metrics()--> AgentReport
        --> Instance.report() (foreign load, KV capacity)

``/health`` is the agent's readiness (engine and every worker rank answer, not draining) and
``/metrics`` is what every agent serves already, so the router needs no second protocol. An
agent that refuses the connection, cannot be reached (a connect timeout) or answers 503 gets
no traffic for the cooldown after each such poll, and the router's /health does not count
it until a poll finds it serving again. An agent that is merely slow to answer (a
loaded machine, a long /metrics) keeps its traffic: slowness is not death, and treating it so
would empty the pool exactly under load; the router's /health stops counting it only after
UNRESPONSIVE_AFTER_S without any answer. Each verdict is kept per instance for /health. The
agent's gRPC control API (``Stats``: backlog prompt tokens, queue seconds) would make the
foreign backlog exact instead of estimated; the router does not depend on it yet.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from slipstream.agent.router.instances import (
    LATE, NOT_SERVING, SERVING, AgentReport, Instance, InstanceTable)
from slipstream.contracts import metric_names as names

log = logging.getLogger(__name__)
KV_BLOCK_TOKENS = 16  # the agents' paged KV block size
POLL_TIMEOUT_S = 5.0  # a loaded agent may take seconds to answer; that alone is no failure


def parse_agent_metrics(text: str) -> AgentReport:
    """In-flight requests by phase and KV capacity from an agent's exposition text."""
    in_flight = {"prefill": 0.0, "decode": 0.0}
    kv_blocks = None
    tier_blocks = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == names.REQUESTS_IN_FLIGHT.name:
            for sample in family.samples:
                phase = sample.labels.get("phase")
                if phase in in_flight:
                    in_flight[phase] += sample.value
        elif family.name == names.KV_BLOCKS_CAPACITY.name and family.samples:
            kv_blocks = family.samples[0].value
        elif family.name == names.KV_TIER_BLOCKS_CAPACITY.name:
            tier_blocks = sum(sample.value for sample in family.samples)
    return AgentReport(prefill_requests=int(in_flight["prefill"]),
                       decode_requests=int(in_flight["decode"]),
                       kv_capacity_tokens=int(kv_blocks * KV_BLOCK_TOKENS) if kv_blocks else None,
                       kv_tier_capacity_tokens=int(tier_blocks * KV_BLOCK_TOKENS))


class StatsPoller:
    def __init__(self, table: InstanceTable, client: httpx.AsyncClient, interval_s: float,
                 unhealthy_cooldown_s: float) -> None:
        self._table = table
        self._client = client
        self._interval_s = interval_s
        self._cooldown_s = unhealthy_cooldown_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="stats-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self) -> None:
        instances = list(self._table)
        await asyncio.gather(*(self._poll(instance) for instance in instances))
        self._table.changed()  # foreign load may have dropped: waiting requests may fit now

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # never let one odd answer end the poller
                log.exception("stats poll failed")
            await asyncio.sleep(self._interval_s)

    async def _poll(self, instance: Instance) -> None:
        timeout_s = max(POLL_TIMEOUT_S, self._interval_s)
        try:
            health = await self._client.get(f"{instance.spec.url}/health", timeout=timeout_s)
            if health.status_code != 200:
                self._not_serving(instance, f"/health answered {health.status_code}")
                return
            response = await self._client.get(f"{instance.spec.url}/metrics", timeout=timeout_s)
            response.raise_for_status()
            report = parse_agent_metrics(response.text)
        except httpx.ConnectTimeout:
            # Nothing took the connection: a busy process still has the kernel accept it,
            # so this is a host that is gone (or a network that drops the packets).
            self._not_serving(instance, "connecting timed out")
            return
        except httpx.TimeoutException as error:
            log.info("stats of %s are late (%s); keeping its traffic", instance.name,
                     type(error).__name__)
            instance.polled(LATE, time.monotonic(), f"no answer in {timeout_s:.0f} s")
            return
        except (httpx.HTTPError, ValueError) as error:
            self._not_serving(instance, _describe(error))
            return
        instance.report(report)
        instance.polled(SERVING, time.monotonic())

    def _not_serving(self, instance: Instance, why: str) -> None:
        if self._table.get(instance.name) is instance:
            if instance.poll_state != NOT_SERVING or instance.poll_reason != why:
                log.info("%s is not serving (%s); no traffic for %.0f s", instance.name, why,
                         self._cooldown_s)
            instance.mark_failed(time.monotonic(), self._cooldown_s)
            instance.polled(NOT_SERVING, time.monotonic(), why)


def _describe(error: Exception) -> str:
    """A short reason for /health: the error's kind, and its text when it has one."""
    text = str(error).strip()
    kind = type(error).__name__
    return f"{kind}: {text[:160]}" if text else kind
