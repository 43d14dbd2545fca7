"""The short/long pool rebalancer: PLA-Serve's instance-pressure controller (Algorithm 2).

    every periodSeconds: agent control API Stats of each instance --> InstanceSignals
      --decide(signals, settings, now_s, last_move_s)--> RebalanceDecision
      --> operator/handle_rebalance.py: relabel the moved instance's pods, Event, status.pools
      (or, simulated, sim/pools.py: relabel the simulated instance)

Per instance k, pressure is ``psi_k = alpha*q_k + beta*e_k - gamma*u_k`` (the paper's signs):
queue backlog ``q`` (seconds of queued prefill work) and SLO deviation ``e`` (how far recent
TTFTs overshoot their target, relative) are symptoms of too few instances; utilisation ``u``
(busy fraction of the engine) counts against pressure as in the paper, since an instance that
keeps its GPU busy without backlog or misses is absorbing its load. Each pool's pressure is
the P90 of its instances' pressures, robust to one straggler.

After the cooldown, one instance moves from pool B to pool A when
``P_A > (1 + tau) * P_B`` and pool B keeps more than ``minPerPool``: the paper's single-step
hill climb. The paper's relative test alone misfires near zero and for negative pressures
(two idle pools at 0.01 and 0.0 differ "infinitely"), so the gap must also exceed
``tau * max(|P_B|, 1)``: relative for large pressures, absolute near zero.
The instance that moves is the donor pool's least pressured one (it has the least queued
work to finish under its old role).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.crds.servingreplica import Rebalance, RebalanceWeights

SHORT, LONG = "short", "long"


@dataclass(frozen=True)
class InstanceSignals:
    instance: str
    pool: str  # short or long
    queue_backlog_s: float
    slo_deviation: float
    utilization: float


# Outcomes of one control step; they become the PoolsBalanced condition's reason.
MOVED, BALANCED, COOLING_DOWN, AT_MIN_PER_POOL, NO_STATS = (
    "InstanceMoved", "WithinHysteresis", "CoolingDown", "AtMinPerPool", "NoStats")


@dataclass(frozen=True)
class Move:
    instance: str
    from_pool: str
    to_pool: str


@dataclass(frozen=True)
class RebalanceDecision:
    outcome: str
    reason: str
    pressure_short: float | None
    pressure_long: float | None
    move: Move | None = None  # set exactly when the outcome is MOVED

    @property
    def moves(self) -> bool:
        return self.move is not None


def instance_pressure(signals: InstanceSignals, weights: RebalanceWeights) -> float:
    return (weights.queue * signals.queue_backlog_s + weights.slo_deviation * signals.slo_deviation
            - weights.utilization * signals.utilization)


def percentile(values: list[float], fraction: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pool_pressures(signals: list[InstanceSignals],
                   weights: RebalanceWeights) -> dict[str, float | None]:
    return {pool: percentile([instance_pressure(s, weights) for s in signals if s.pool == pool],
                             0.9)
            for pool in (SHORT, LONG)}


def exceeds(hot: float, cold: float, hysteresis: float) -> bool:
    """Is ``hot`` beyond ``cold`` by more than the hysteresis band (see module docstring)?"""
    return hot > (1 + hysteresis) * cold and hot - cold > hysteresis * max(abs(cold), 1.0)


def decide(signals: list[InstanceSignals], settings: Rebalance, now_s: float,
           last_move_s: float | None) -> RebalanceDecision:
    """One control step. ``last_move_s`` is when an instance last moved (None: never)."""
    pressures = pool_pressures(signals, settings.weights)
    p_short, p_long = pressures[SHORT], pressures[LONG]
    if p_short is None or p_long is None:
        return RebalanceDecision(NO_STATS, "a pool has no instance reporting stats",
                                 p_short, p_long)
    if exceeds(p_short, p_long, settings.hysteresis):
        hot, cold, p_hot, p_cold = SHORT, LONG, p_short, p_long
    elif exceeds(p_long, p_short, settings.hysteresis):
        hot, cold, p_hot, p_cold = LONG, SHORT, p_long, p_short
    else:
        return RebalanceDecision(BALANCED, f"P90 pressure short={p_short:.3f}, "
                                 f"long={p_long:.3f}: within hysteresis {settings.hysteresis}",
                                 p_short, p_long)
    imbalance = (f"P90 pressure {hot}={p_hot:.3f} exceeds {cold}={p_cold:.3f} beyond "
                 f"hysteresis {settings.hysteresis}")
    if last_move_s is not None and now_s - last_move_s < settings.cooldown_seconds:
        remaining_s = settings.cooldown_seconds - (now_s - last_move_s)
        return RebalanceDecision(COOLING_DOWN, f"{imbalance}; cooling down for another "
                                 f"{remaining_s:.0f} s", p_short, p_long)
    donors = [s for s in signals if s.pool == cold]
    if len(donors) <= settings.min_per_pool:
        return RebalanceDecision(AT_MIN_PER_POOL, f"{imbalance}; the {cold} pool is at "
                                 f"minPerPool ({settings.min_per_pool})", p_short, p_long)
    donor = min(donors, key=lambda s: (instance_pressure(s, settings.weights), s.instance))
    return RebalanceDecision(MOVED, imbalance, p_short, p_long,
                             move=Move(instance=donor.instance, from_pool=cold, to_pool=hot))
