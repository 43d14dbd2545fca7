"""Length-aware pools in the simulator: a length router over short/long instances, and the
operator's pool rebalancer run on the simulated clock.

    arrival --PoolRouter.route()--> pool by prompt length --> least backlog inside the pool
    every period: SimInstance.load / backlog --> InstanceSignals
        --decisions.pools.decide()--> at most one relabel per cooldown

The rebalancer is the operator's own pure ``decide`` (PLA-Serve Algorithm 2), not a copy, and
the signals are built the way the live agent builds them: queue backlog is the prompt tokens
still to prefill priced at the instance's recent prefill rate (``EngineStats``), utilisation
and SLO deviation come from the same ``LoadWindow`` the engine keeps. A moved instance keeps
the work it already holds and finishes it under its new label, as a relabelled pod does.

The length test is the router's rule (``prompt_tokens >= threshold`` is long). The router's
``LengthClassifier`` itself is not used: it tokenizes HTTP bodies through the engine
tokenizer, and here the prompt length is already a number.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.agent.engine.step.stats import NOMINAL_PREFILL_TOKENS_PER_S
from slipstream.sim.instance import RequestRecord, SimInstance
from slipstream.crds.servingreplica import Rebalance
from slipstream.decisions.pools import LONG, SHORT, InstanceSignals, RebalanceDecision, decide

POOL_MODES = ("static", "rebalanced")


@dataclass(frozen=True)
class PoolsConfig:
    mode: str  # static: the split never changes; rebalanced: the operator's controller runs
    short_instances: int  # initial short-pool size; the rest start long
    long_threshold_tokens: int = 8192
    rebalance: Rebalance = field(default_factory=Rebalance)

    def __post_init__(self) -> None:
        if self.mode not in POOL_MODES:
            raise ValueError(f"pools mode must be one of {POOL_MODES}, not {self.mode!r}")
        if self.short_instances < 0 or self.long_threshold_tokens < 1:
            raise ValueError("short_instances must be >= 0 and long_threshold_tokens >= 1")


def pool_of(prompt_tokens: int, long_threshold_tokens: int) -> str:
    return LONG if prompt_tokens >= long_threshold_tokens else SHORT


def instance_signals(instance: SimInstance, pool: str, now_s: float) -> InstanceSignals:
    snapshot = instance.load.snapshot(now_s)
    rate = snapshot.prefill_tokens_per_s or NOMINAL_PREFILL_TOKENS_PER_S
    return InstanceSignals(instance=str(instance.index), pool=pool,
                           queue_backlog_s=instance.backlog_prompt_tokens() / rate,
                           slo_deviation=snapshot.slo_deviation,
                           utilization=snapshot.utilization)


class PoolRouter:
    """Which pool each instance is in, where a request goes, and the rebalancing steps."""

    def __init__(self, config: PoolsConfig, num_instances: int) -> None:
        if config.short_instances > num_instances:
            raise ValueError(f"short_instances ({config.short_instances}) exceeds the "
                             f"{num_instances} instances")
        self.config = config
        self.pools = [SHORT if i < config.short_instances else LONG
                      for i in range(num_instances)]
        self.last_move_s: float | None = None
        self.moves: list[dict] = []  # one entry per relabel, for the report
        self.decisions = 0
        period_s = float(config.rebalance.period_seconds)
        self.next_control_s = period_s if config.mode == "rebalanced" else float("inf")

    def route(self, record: RequestRecord, instances: list[SimInstance]) -> SimInstance:
        pool = pool_of(record.prompt_tokens, self.config.long_threshold_tokens)
        members = [inst for inst in instances if self.pools[inst.index] == pool]
        # An empty pool (a split of 0) leaves its class to the other pool rather than dropping it.
        return min(members or instances, key=lambda inst: inst.backlog_tokens)

    def pool_sizes(self) -> dict[str, int]:
        return {pool: self.pools.count(pool) for pool in (SHORT, LONG)}

    def control_step(self, instances: list[SimInstance], now_s: float) -> RebalanceDecision:
        """One period of the operator's loop; schedules the next one."""
        self.next_control_s = now_s + float(self.config.rebalance.period_seconds)
        signals = [instance_signals(inst, self.pools[inst.index], now_s) for inst in instances]
        decision = decide(signals, self.config.rebalance, now_s, self.last_move_s)
        self.decisions += 1
        move = decision.move
        if move is not None:
            index = int(move.instance)
            self.pools[index] = move.to_pool
            self.last_move_s = now_s
            self.moves.append({"time_s": now_s, "instance": index, "from": move.from_pool,
                               "to": move.to_pool,
                               "pressure_short": decision.pressure_short,
                               "pressure_long": decision.pressure_long,
                               "sizes": self.pool_sizes()})
        return decision
