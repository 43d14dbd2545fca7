"""What an autoscaling step reads and writes, as plain data: the load each instance reports
(``InstanceLoad``), the instances still starting, the history one step leaves for the next,
and the decision (``decide_scale`` in ``autoscale.py`` makes it)."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.crds.servingreplica import UNIFIED_POOL
from slipstream.decisions.trend import Trend


@dataclass(frozen=True)
class InstanceLoad:
    """One ready instance's load window, as its agent reports it."""

    instance: str
    pool: str = UNIFIED_POOL
    first_tokens: int = 0  # first tokens with a TTFT target in the window
    ttft_met: int = 0
    finished: int = 0  # finished requests with a TPOT target in the window
    tpot_met: int = 0
    queue_delay_s: float = 0.0  # seconds of queued prefill work
    kv_utilization: float = 0.0  # fraction of KV blocks in use
    busy_fraction: float = 0.0  # fraction of the window the engine ran steps
    prefill_load: float = 0.0  # seconds of prefill work arriving per second
    slo_deviation: float = 0.0  # for the pools' pressure


@dataclass(frozen=True)
class Starting:
    """A placed instance that does not report yet (starting, or not answering)."""

    instance: str
    pool: str = UNIFIED_POOL


@dataclass(frozen=True)
class ScaleSignals:
    loads: tuple[InstanceLoad, ...]  # ready instances that answered
    starting: tuple[Starting, ...] = ()

    @property
    def current(self) -> int:
        return len(self.loads) + len(self.starting)

    def size(self, pool: str) -> int:
        return sum(1 for x in self.loads + self.starting if x.pool == pool)


@dataclass(frozen=True)
class ScaleHistory:
    """What the decisions before this one leave for it: (time, recommendation) pairs within
    the longer stabilisation window, and since when they have been kept."""

    since_s: float
    recommendations: tuple[tuple[float, int], ...] = ()
    last_scale_s: float | None = None
    reporting: int = 0  # how many instances reported at the last step
    reporting_since_s: float | None = None  # since when that many have
    demand: tuple[tuple[float, float], ...] = ()  # (time, summed prefill load) for the trend
    breach_up: tuple[float, int] | None = None  # (time, count) of the last scale-up a breach


@dataclass(frozen=True)
class ScaleDecision:
    current: int
    desired: int
    recommendation: int
    reason: str  # one of OUTCOMES
    message: str
    history: ScaleHistory  # hand it to the next step
    add_pools: tuple[str, ...] = ()  # the pool of each instance to add
    remove: tuple[str, ...] = ()  # the instances to drain, least loaded first
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None
    trend: Trend | None = None  # the prefill load trend, when there is a clear one

    @property
    def delta(self) -> int:
        return self.desired - self.current
