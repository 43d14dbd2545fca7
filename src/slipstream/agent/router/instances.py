"""The router's view of the serving instances: who is in which pool, and how loaded each is.

    pod watch / --backend flags --upsert/remove--> InstanceTable --candidates(class)--> dispatcher
    stats poller --report()--> Instance.load        proxy --start/first_token/finish--> load

Everything here runs on the router's event loop thread; the pod watch thread hands its events
over with ``call_soon_threadsafe``, so nothing needs a lock.

Predicted backlog. An agent's ``/metrics`` says how many requests it holds before and after
their first token, but only as of the last poll, and it counts every router's requests. This
router knows its own requests exactly and at once. So the estimate is this router's live
counts plus the *foreign* part of the last report (reported minus what this router had there
at that moment), in prefill tokens: own pending prompt tokens exactly, foreign prefills at the
pool's mean prompt length, and each decode as ``decode_weight_tokens``.

How much of that backlog a *new* request waits behind depends on the order the instance
serves queued prefills in. Under FCFS it is all of it. Slipstream's LARS serves a request
whose prefill is short in a lane ahead of longer ones (docs/scheduling.md), so a request of
``u`` uncached tokens waits behind at most ``u`` tokens of each queued prefill: smaller ones
finish before it, larger ones take turns with it or wait. ``predicted_backlog_tokens(...,
ahead_of=u)`` counts each prefill as ``min(its tokens, u)``. That is what lets a short
follow-up go home to the instance that holds its long document even when that instance is
busy with other long prefills: there it is a short request, elsewhere a long one.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slipstream.agent.router.config import DECODE_POOL, LONG_POOL, SHORT_POOL, UNIFIED_POOL

# An instance's health as the router sees it (its /health lists one per instance).
UNKNOWN = "unknown"  # not polled yet
SERVING = "serving"  # its /health said 200 and its /metrics parsed
NOT_SERVING = "not_serving"  # refused, unreachable, or its /health said no (draining...)
LATE = "late"  # did not answer the last poll in time; still gets traffic
UNRESPONSIVE = "unresponsive"  # late for UNRESPONSIVE_AFTER_S: not counted as serving
COOLING_DOWN = "cooling_down"  # a request to it just failed; no traffic for the cooldown
UNRESPONSIVE_AFTER_S = 30.0
# Which pools may serve a request class, in order of preference.
_POOLS_FOR_CLASS = {SHORT_POOL: (SHORT_POOL, UNIFIED_POOL), LONG_POOL: (LONG_POOL, UNIFIED_POOL),
                    DECODE_POOL: (DECODE_POOL,)}


@dataclass(frozen=True)
class BackendSpec:
    """One instance as discovery sees it."""

    name: str  # stable key: the pod name, or the URL in static mode
    url: str  # http://ip:port
    pool: str
    instance: str  # the instance it belongs to (pod label), for metrics and logs


@dataclass(frozen=True)
class AgentReport:
    """What one poll of an agent's stats said."""

    prefill_requests: int  # accepted, no first token yet (queued or prefilling)
    decode_requests: int
    kv_capacity_tokens: int | None
    kv_tier_capacity_tokens: int = 0  # its host and disk KV tiers together


class Instance:
    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.own_prefill_requests = 0
        self.own_prefill_tokens = 0
        self._own_prefill_sizes: Counter[int] = Counter()  # own pending prefills by tokens
        self.own_decode_requests = 0
        self.own_kv_tokens = 0  # prompt tokens of this router's requests here, any phase
        self._foreign_prefill_requests = 0
        self._foreign_decode_requests = 0
        self.kv_capacity_tokens: int | None = None
        self.kv_tier_capacity_tokens = 0
        self.unhealthy_until_s = 0.0
        # The stats poller's last verdict, for dispatch and the router's /health.
        self.poll_state = UNKNOWN
        self.poll_reason = ""
        self.last_answer_s: float | None = None  # when it last answered a poll at all

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pool(self) -> str:
        return self.spec.pool

    @property
    def own_in_flight(self) -> int:
        return self.own_prefill_requests + self.own_decode_requests

    @property
    def in_flight(self) -> int:
        return self.own_in_flight + self._foreign_prefill_requests + self._foreign_decode_requests

    def healthy(self, now_s: float) -> bool:
        """May take traffic: not cooling down after a failure. After the cooldown a refused
        instance is tried again (a request that cannot connect is retried elsewhere);
        /health (``health_state``) keeps it out until a poll finds it serving."""
        return now_s >= self.unhealthy_until_s

    def health_state(self, now_s: float) -> str:
        """What the router's /health says of it (see the constants above)."""
        if self.poll_state == NOT_SERVING:
            return NOT_SERVING
        if now_s < self.unhealthy_until_s:
            return COOLING_DOWN
        if self.poll_state == LATE and (self.last_answer_s is None
                                        or now_s - self.last_answer_s >= UNRESPONSIVE_AFTER_S):
            return UNRESPONSIVE
        return self.poll_state

    def health_view(self, now_s: float) -> dict:
        age = None if self.last_answer_s is None else round(now_s - self.last_answer_s, 1)
        return {"name": self.name, "url": self.spec.url, "pool": self.pool,
                "state": self.health_state(now_s), "reason": self.poll_reason,
                "last_answer_seconds_ago": age}

    def polled(self, state: str, now_s: float, reason: str = "") -> None:
        """Record a poll's outcome: SERVING or NOT_SERVING (an answer, or a refusal), or LATE
        (no answer in time: it keeps its traffic; slowness is not death)."""
        if state != LATE:
            self.last_answer_s = now_s
        if state == LATE and self.poll_state == UNKNOWN:
            self.last_answer_s = None
        self.poll_state, self.poll_reason = state, reason

    def mark_failed(self, now_s: float, cooldown_s: float) -> None:
        self.unhealthy_until_s = now_s + cooldown_s

    def predicted_kv_tokens(self, mean_prompt_tokens: float) -> float:
        """KV a decode instance holds: this router's requests there exactly, the others'
        at the mean prompt length."""
        foreign = self._foreign_prefill_requests + self._foreign_decode_requests
        return self.own_kv_tokens + foreign * mean_prompt_tokens

    def predicted_backlog_tokens(self, decode_weight_tokens: float, mean_prompt_tokens: float,
                                 ahead_of: int | None = None) -> float:
        """Prefill tokens to compute here, plus each decode at ``decode_weight_tokens``. With
        ``ahead_of`` (a new request's uncached prompt tokens), only the part a new request
        that size waits behind on a shorter-first instance: each prefill up to that many."""
        decodes = self.own_decode_requests + self._foreign_decode_requests
        if ahead_of is None:
            prefill = self.own_prefill_tokens + self._foreign_prefill_requests * mean_prompt_tokens
        else:
            prefill = sum(min(size, ahead_of) * count
                          for size, count in self._own_prefill_sizes.items())
            prefill += self._foreign_prefill_requests * min(mean_prompt_tokens, ahead_of)
        return prefill + decodes * decode_weight_tokens

    # -- this router's requests (the proxy calls these) ---------------------------------------

    def start(self, prompt_tokens: int) -> None:
        self.own_prefill_requests += 1
        self.own_prefill_tokens += prompt_tokens
        self._own_prefill_sizes[prompt_tokens] += 1
        self.own_kv_tokens += prompt_tokens

    def first_token(self, prompt_tokens: int) -> None:
        self._prefill_done(prompt_tokens)
        self.own_decode_requests += 1

    def finish(self, prompt_tokens: int, reached_first_token: bool) -> None:
        self.own_kv_tokens -= prompt_tokens
        if reached_first_token:
            self.own_decode_requests -= 1
        else:
            self._prefill_done(prompt_tokens)

    def _prefill_done(self, prompt_tokens: int) -> None:
        self.own_prefill_requests -= 1
        self.own_prefill_tokens -= prompt_tokens
        sizes = self._own_prefill_sizes
        sizes[prompt_tokens] -= 1
        if sizes[prompt_tokens] <= 0:
            del sizes[prompt_tokens]

    # -- the agent's own report ---------------------------------------------------------------

    def report(self, report: AgentReport) -> None:
        # Requests this router sent that the agent has not registered yet (or already
        # finished) make the difference negative; count those as no foreign load.
        self._foreign_prefill_requests = max(0, report.prefill_requests
                                             - self.own_prefill_requests)
        self._foreign_decode_requests = max(0, report.decode_requests - self.own_decode_requests)
        if report.kv_capacity_tokens:
            self.kv_capacity_tokens = report.kv_capacity_tokens
        self.kv_tier_capacity_tokens = report.kv_tier_capacity_tokens
        self.unhealthy_until_s = 0.0  # it answered


class InstanceTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._instances: dict[str, Instance] = {}
        self._clock = clock
        self._listeners: list[Callable[[], None]] = []
        self._prompt_tokens_seen = {SHORT_POOL: 0, LONG_POOL: 0, DECODE_POOL: 0}
        self._requests_seen = {SHORT_POOL: 0, LONG_POOL: 0, DECODE_POOL: 0}

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` after membership or capacity changes (to drain waiting queues)."""
        self._listeners.append(listener)

    def changed(self) -> None:
        for listener in self._listeners:
            listener()

    def __iter__(self):
        return iter(list(self._instances.values()))

    def __len__(self) -> int:
        return len(self._instances)

    def get(self, name: str) -> Instance | None:
        return self._instances.get(name)

    def upsert(self, spec: BackendSpec) -> None:
        """Add an instance, or apply a relabel (new pool) or a new address to a known one."""
        current = self._instances.get(spec.name)
        if current is None:
            self._instances[spec.name] = Instance(spec)
        elif current.spec != spec:
            current.spec = spec  # in-flight requests keep their counts where they run
        else:
            return
        self.changed()

    def remove(self, name: str) -> None:
        if self._instances.pop(name, None) is not None:
            self.changed()

    def replace_all(self, specs: Iterable[BackendSpec]) -> None:
        """Make the table exactly ``specs`` (after a full list of pods)."""
        by_name = {spec.name: spec for spec in specs}
        for name in set(self._instances) - set(by_name):
            del self._instances[name]
        for spec in by_name.values():
            current = self._instances.get(spec.name)
            if current is None:
                self._instances[spec.name] = Instance(spec)
            else:
                current.spec = spec
        self.changed()

    def candidates(self, request_class: str) -> list[Instance]:
        """Healthy instances that may serve ``request_class``: its own pool (and unified
        ones); when that pool is empty, every healthy instance rather than no service.
        Decode instances serve only decode legs, and decode legs only go to them."""
        now_s = self._clock()
        healthy = [instance for instance in self._instances.values() if instance.healthy(now_s)]
        if request_class == DECODE_POOL:
            return [instance for instance in healthy if instance.pool == DECODE_POOL]
        healthy = [instance for instance in healthy if instance.pool != DECODE_POOL]
        own = [instance for instance in healthy if instance.pool in _POOLS_FOR_CLASS[request_class]]
        return own or healthy

    def has_decode_instances(self) -> bool:
        """True while the table knows a decode instance (healthy or not): the deployment
        is disaggregated, so requests are chained through one."""
        return any(instance.pool == DECODE_POOL for instance in self._instances.values())

    def decode_available(self) -> bool:
        """Whether a decode leg could be placed now: some decode instance is not cooling
        down after a failure and was not last found refusing or silent. Without one a
        request is served whole by a prefill or mixed instance instead of chained."""
        now_s = self._clock()
        return any(instance.health_state(now_s) not in (NOT_SERVING, UNRESPONSIVE)
                   for instance in self.candidates(DECODE_POOL))

    def serving_count(self) -> int:
        """Instances that serve now by the last poll: answered 200, or answered late for
        less than UNRESPONSIVE_AFTER_S; not refused, down, cooling down or not polled yet."""
        now_s = self._clock()
        return sum(1 for instance in self._instances.values()
                   if instance.health_state(now_s) in (SERVING, LATE))

    def health_view(self) -> list[dict]:
        now_s = self._clock()
        return [instance.health_view(now_s)
                for instance in sorted(self._instances.values(), key=lambda i: i.name)]

    def pool_sizes(self) -> dict[str, int]:
        sizes = {pool: 0 for pool in (SHORT_POOL, LONG_POOL, UNIFIED_POOL, DECODE_POOL)}
        for instance in self._instances.values():
            sizes[instance.pool] = sizes.get(instance.pool, 0) + 1
        return sizes

    def observe_prompt(self, request_class: str, prompt_tokens: int) -> None:
        self._prompt_tokens_seen[request_class] += prompt_tokens
        self._requests_seen[request_class] += 1

    def mean_prompt_tokens(self, request_class: str) -> float:
        seen = self._requests_seen[request_class]
        return self._prompt_tokens_seen[request_class] / seen if seen else 0.0
