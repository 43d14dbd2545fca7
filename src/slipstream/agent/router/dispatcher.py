"""Which instance serves a request, and when: least predicted backlog, fair queue when full.

    RoutedRequest --acquire()--> an unsaturated candidate with the least predicted backlog
                                 minus the prefill its prefix cache saves (prefix_affinity.py)
                                 (none: wait in the class's FairQueue, smallest tag first)
                 --> Lease --first_token() / finish()--> instance load; a freed slot drains
                                                          the queue

Candidates are the instances of the request's pool (plus unified ones), from
``InstanceTable.candidates``. An instance is saturated at ``max_in_flight_per_instance``
requests (this router's and others', as last reported) or at
``max_backlog_tokens_per_instance`` predicted backlog. A retry passes the instances already
tried in ``exclude`` and keeps its first fairness tag, so it does not lose its place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slipstream.agent.router.classify import RoutedRequest
from slipstream.agent.router.config import DECODE_POOL, DISPATCH_CLASSES, RouterConfig
from slipstream.agent.router.fair_queue import FairQueue
from slipstream.agent.router.instances import Instance, InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.prefix_affinity import PrefixAffinityIndex


class NoInstanceError(Exception):
    """No instance can take the request (none left to try, or the queue wait ran out)."""


@dataclass(eq=False)
class _Waiter:
    routed: RoutedRequest
    finish_tag: float
    exclude: frozenset[str]
    future: asyncio.Future = field(repr=False)


class Lease:
    """One attempt of one request on one instance; keeps the instance's load counts honest."""

    def __init__(self, dispatcher: Dispatcher, instance: Instance, routed: RoutedRequest,
                 finish_tag: float) -> None:
        self._dispatcher = dispatcher
        self.instance = instance
        self.routed = routed
        self.finish_tag = finish_tag
        self.reached_first_token = False
        self.finished = False
        # The prefill this request adds to the instance: what its cache is thought to lack.
        self.prefill_tokens = routed.prompt_tokens - dispatcher.cached_tokens(instance, routed)
        dispatcher.routed_to(instance, routed)
        instance.start(self.prefill_tokens)

    def first_token(self) -> None:
        if not self.reached_first_token and not self.finished:
            self.reached_first_token = True
            self.instance.first_token(self.prefill_tokens)

    def finish(self, output_tokens: int | None = None) -> None:
        """Release the slot; ``output_tokens`` (on success) teaches the demand predictor."""
        if self.finished:
            return
        self.finished = True
        self.instance.finish(self.prefill_tokens, self.reached_first_token)
        self._dispatcher.released(self, output_tokens)


class Dispatcher:
    def __init__(self, table: InstanceTable, config: RouterConfig, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._table = table
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self.queues: dict[str, FairQueue[_Waiter]] = {
            request_class: FairQueue(config.fairness) for request_class in DISPATCH_CLASSES}
        # Spreads ties between idle instances: one counter per dispatch class, advanced
        # only when that class grants a lease. A counter shared by a chain's prefill and
        # decode choices advanced twice per request, so with two idle decode instances
        # every decode leg saw the same offset and went to the same one (issue 30).
        self._rotation = {request_class: 0 for request_class in DISPATCH_CLASSES}
        self.affinity = PrefixAffinityIndex(config.prefix_block_tokens or 1)
        table.on_change(self.drain)

    def cached_tokens(self, instance: Instance, routed: RoutedRequest) -> int:
        """Prompt tokens ``instance`` probably holds in its prefix cache, in any tier (never
        the last)."""
        if not routed.prefix_keys:
            return 0
        return min(max(0, routed.prompt_tokens - 1),
                   self.affinity.cached_tokens(instance.name, routed.prefix_keys))

    def cached_value(self, instance: Instance, routed: RoutedRequest) -> float:
        """``cached_tokens``, with a token held in a lower KV tier worth
        ``lower_tier_hit_weight`` of one on the device (it is loaded, not recomputed)."""
        if not routed.prefix_keys:
            return 0.0
        device, lower = self.affinity.cached_split(instance.name, routed.prefix_keys)
        most = max(0, routed.prompt_tokens - 1)
        device = min(device, most)
        return device + self._config.lower_tier_hit_weight * min(lower, most - device)

    def routed_to(self, instance: Instance, routed: RoutedRequest) -> None:
        if routed.prefix_keys:
            self.affinity.record(instance.name, routed.prefix_keys, instance.kv_capacity_tokens,
                                 instance.kv_tier_capacity_tokens)

    def queue_depth(self, request_class: str) -> int:
        return len(self.queues[request_class])

    def tag(self, routed: RoutedRequest) -> float:
        """The request's fairness tag, taken once (a retry keeps it)."""
        return self.queues[routed.request_class].tag(routed.app_id, routed.prompt_tokens,
                                                     routed.max_tokens, routed.share_weight)

    async def acquire(self, routed: RoutedRequest, finish_tag: float,
                      exclude: frozenset[str] = frozenset()) -> Lease:
        if not any(instance.name not in exclude
                   for instance in self._table.candidates(routed.request_class)):
            raise NoInstanceError("no serving instance is available for this request")
        queue = self.queues[routed.request_class]
        if not len(queue):
            instance = self._pick(routed, exclude)
            if instance is not None:
                queue.dispatched(finish_tag)
                return self._grant(instance, routed, finish_tag)
        waiter = _Waiter(routed, finish_tag, exclude, asyncio.get_running_loop().create_future())
        queue.push(finish_tag, waiter)
        started_s = self._clock()
        self.drain()  # the queue may have been empty for a reason that no longer holds
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future),
                                          self._config.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as error:
            queue.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().finish()  # granted just as we gave up
            waiter.future.cancel()
            if isinstance(error, asyncio.CancelledError):
                raise
            raise NoInstanceError(f"every instance stayed saturated for "
                                  f"{self._config.queue_timeout_s:.0f} s") from None
        finally:
            self._metrics.queue_wait_s.labels(routed.request_class).observe(
                self._clock() - started_s)

    def released(self, lease: Lease, output_tokens: int | None) -> None:
        if output_tokens is not None:
            self.queues[lease.routed.request_class].demand.observe(lease.routed.app_id,
                                                                   output_tokens)
        self.drain()

    def drain(self) -> None:
        """Grant waiting requests, smallest virtual finish time first, while slots are free."""
        for request_class, queue in self.queues.items():
            skipped: list[_Waiter] = []
            while len(queue):
                waiter = queue.peek()
                if waiter.future.done():
                    queue.pop()
                    continue
                instance = self._pick(waiter.routed, waiter.exclude)
                if instance is None:
                    if self._pick(waiter.routed, frozenset()) is None:
                        break  # the class is full: the head waits for the next release
                    skipped.append(queue.pop())  # only instances it already tried are free
                    continue
                queue.pop()
                queue.dispatched(waiter.finish_tag)
                waiter.future.set_result(self._grant(instance, waiter.routed, waiter.finish_tag))
            for waiter in skipped:
                queue.push(waiter.finish_tag, waiter)

    def _grant(self, instance: Instance, routed: RoutedRequest, finish_tag: float) -> Lease:
        self._rotation[routed.request_class] += 1
        return Lease(self, instance, routed, finish_tag)

    def _pick(self, routed: RoutedRequest, exclude: frozenset[str]) -> Instance | None:
        config = self._config
        mean_prompt = self._table.mean_prompt_tokens(routed.request_class)
        best, best_key = None, None
        candidates = self._table.candidates(routed.request_class)
        offset = self._rotation[routed.request_class]
        decode_leg = routed.request_class == DECODE_POOL
        for position, instance in enumerate(candidates):
            if instance.name in exclude or instance.in_flight >= config.max_in_flight_per_instance:
                continue
            if decode_leg:
                # A decode instance by KV and batch load: the KV it holds (which its batch
                # of decodes must read each step), then how many requests it runs.
                kv_tokens = instance.predicted_kv_tokens(mean_prompt)
                capacity = instance.kv_capacity_tokens
                if capacity and kv_tokens + routed.prompt_tokens > capacity \
                        and instance.in_flight > 0:
                    continue
                key = (kv_tokens, instance.in_flight, (position - offset) % len(candidates))
                if best_key is None or key < best_key:
                    best, best_key = instance, key
                continue
            backlog = instance.predicted_backlog_tokens(config.decode_weight_tokens, mean_prompt)
            limit = config.max_backlog_tokens_per_instance
            if limit is not None and backlog >= limit and instance.in_flight > 0:
                continue  # an idle instance takes even a request larger than the limit
            # Prefix-aware: the prefill its cache saves counts against its backlog, so a
            # follow-up goes where its conversation is unless that instance is busier by
            # more than the prefix is worth. On shorter-first instances the backlog is what
            # this request would wait behind there, given what it still has to compute.
            cached = self.cached_tokens(instance, routed)
            if config.instance_queue_order == "shorter-first":
                backlog = instance.predicted_backlog_tokens(
                    config.decode_weight_tokens, mean_prompt,
                    ahead_of=max(1, routed.prompt_tokens - cached))
            score = backlog - config.prefix_affinity_weight * self.cached_value(instance, routed)
            key = (score, instance.in_flight, (position - offset) % len(candidates))
            if best_key is None or key < best_key:
                best, best_key = instance, key
        return best
