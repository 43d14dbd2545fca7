"""The SLO autoscaler: how many instances a ServingReplica should run now.

    every spec.autoscaling.periodSeconds: agent Stats of each ready instance --> InstanceLoad
      --decide_scale(signals, spec, history, now_s)--> ScaleDecision (+ the next history)
      --> operator/handle_autoscale.py: place new instances as gangs, or drain the chosen one;
          an Event per decision; status.autoscaling
      (or, simulated, sim/autoscale.py: start or drain a simulated instance)

One step, in three stages:

1. **Recommend** from the instances that report (starting ones have no signals yet):
   - *up* when any target is breached beyond the tolerance: TTFT or TPOT attainment (the
     miss rate above ``(1 - target) * (1 + tolerance)``), queueing delay, KV utilisation or
     prefill load (mean above ``target * (1 + tolerance)``). The count is the reporting
     instances scaled by the worst ratio of the proportional signals (prefill load, KV
     utilisation) to their targets, and at least one more than report; instances already
     starting count against the shortage instead of being added again. Queue delay and
     attainment are not proportional to anything (a queue grows without bound past
     saturation), so they ask for one more at a time; but a queue delay breach together with
     a proportional one (a step in load: over the band, with a backlog behind it) sizes the
     new instances to carry the whole load on their own, on top of those reporting: the
     instances holding the backlog take little new work until it has drained, and the
     least-backlog router sends the new ones everything meanwhile;
   - *down* when every signal is below its band (``target * (1 - tolerance)``) and the
     proportional ones still hold their targets on fewer instances ``m``: they grow as
     ``n / m`` when ``n`` instances' load lands on ``m`` (the HPA's rule: the band around the
     value now, the new count sized back to the target). Queue delay and attainment only
     veto;
   - otherwise the current count.

Prefill load (prompt tokens arriving per second over the recent prefill rate) is the load
signal of a continuous-batching engine: the busy fraction saturates near 1 at a fraction of
capacity (the decodes of overlapping requests keep the engine stepping), while the prefill
work arriving grows with the arrival rate, past saturation too (measured in the simulator on
H100 tables: docs/autoscaling.md).
2. **Stabilise** as the Kubernetes HPA does: scale up only to the lowest count recommended
   over ``scaleUpStabilizationSeconds``, down only to the highest over
   ``scaleDownStabilizationSeconds``, and never down before the history covers that window
   (after an operator restart the history is empty: it waits rather than guesses).
3. **Limit**: at most ``maxStep`` instances per step, never outside
   ``[minInstances, maxInstances]``.

With pools, new instances join the pool under the higher P90 pressure (PLA-Serve's pressure
from ``pools.py``) and removed ones leave the less pressured pool, never below minPerPool.
Scaling runs before rebalancing and restarts its cooldown (docs/autoscaling.md says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from slipstream.crds.autoscaling import Autoscaling
from slipstream.crds.servingreplica import UNIFIED_POOL, ServingReplicaSpec
from slipstream.decisions.pools import LONG, SHORT, InstanceSignals, instance_pressure, pool_pressures
from slipstream.decisions.trend import Trend, fit_trend
from slipstream.decisions.scale_signals import (InstanceLoad, ScaleDecision, ScaleHistory,
                                                ScaleSignals)

# Attainment over fewer first tokens (or finished requests) than this is noise, not a signal.
MIN_ATTAINMENT_SAMPLES = 20
# The agents' load window: attainment and queue delay describe its past, so for this long
# after the set of reporting instances changed they still show the shortage that the new
# instances have just ended (the backlog left on the old ones). They do not add instances
# then; the proportional signals, averaged over the instances now reporting, still do.
SETTLE_S = 30.0
# After a scale-up that a breach asked for (a step in load, not a ramp), the summed prefill
# load keeps rising for a while as the backlog of the overloaded instances drains onto the
# new ones: read as a ramp, it sized for a 3rd and a 4th instance at a step that needed 2
# (the step workload in docs/autoscaling.md). So the forecast adds no instance until the
# instances reporting have been the same for forecastWindowSeconds since that scale-up (the
# window then holds none of the transition), or the replica has fewer instances than that
# scale-up asked for (a scale-down, or instances lost). Breaches still scale up meanwhile.

# Outcomes: the status's lastScaleReason and the Event's reason.
SCALE_UP, SCALE_DOWN = "ScaleUp", "ScaleDown"
WITHIN_TARGETS, STABILIZING, AT_MAX, AT_MIN, NO_SIGNALS = (
    "WithinTargets", "Stabilizing", "AtMaxInstances", "AtMinInstances", "NoSignals")
OUTCOMES = (SCALE_UP, SCALE_DOWN, WITHIN_TARGETS, STABILIZING, AT_MAX, AT_MIN, NO_SIGNALS)


    # asked for: the forecast hold


@dataclass(frozen=True)
class _Load:
    """The replica-wide view of the reporting instances."""

    count: int
    ttft_attainment: float | None
    tpot_attainment: float | None
    queue_delay_s: float
    kv_utilization: float
    prefill_load: float


def attainment(met: int, total: int) -> float | None:
    return met / total if total >= MIN_ATTAINMENT_SAMPLES else None


def _aggregate(loads: tuple[InstanceLoad, ...]) -> _Load:
    count = len(loads)
    return _Load(
        count=count,
        ttft_attainment=attainment(sum(x.ttft_met for x in loads),
                                   sum(x.first_tokens for x in loads)),
        tpot_attainment=attainment(sum(x.tpot_met for x in loads),
                                   sum(x.finished for x in loads)),
        queue_delay_s=sum(x.queue_delay_s for x in loads) / count,
        kv_utilization=sum(x.kv_utilization for x in loads) / count,
        prefill_load=sum(x.prefill_load for x in loads) / count)


def recommend(load: _Load, settings: Autoscaling, current: int, settled: bool = True,
              trend: Trend | None = None, forecast_up: bool = True,
              misses_settled: bool | None = None) -> tuple[int, str, bool]:
    """Stage 1: the count these signals ask for, why, and whether a breach asks for more
    than ``current``. ``settled``: the reporting instances have been the same for SETTLE_S
    (else attainment and queue delay, which describe the window's past, do not ask for
    more). ``trend``: a clear trend of the summed prefill load; up, it asks for the count the
    load will need ``forecastSeconds`` ahead (unless ``forecast_up`` is False: the hold after
    a breach's scale-up); down, it lets a scale-down size to the load at the end of the
    scale-down window. ``misses_settled`` (default ``settled``): whether attainment may ask
    for more (False during a breach's hold once its queue is gone: the misses are its past)."""
    targets, tolerance = settings.targets, settings.tolerance
    if misses_settled is None:
        misses_settled = settled
    n = load.count
    ceiling = targets.prefill_load * (1.0 + tolerance)
    forecast = trend is not None and settings.forecast_seconds > 0
    ahead_wanted, ahead_why = current, ""
    if trend is not None and trend.slope_per_s > 0 and forecast and forecast_up:
        ahead = trend.at(settings.forecast_seconds)
        if ahead / current > ceiling:
            # Sized so that the load ahead stays inside the band (not back at the target):
            # the forecast is already the headroom, and a second one on top of it is the
            # overshoot of a line extrapolated past the top of a curve.
            ahead_wanted = max(current + 1, math.ceil(ahead / ceiling - 1e-9))
            ahead_why = (f"prefill load {load.prefill_load:.3f} rising "
                         f"{trend.slope_per_s * 60 / n:+.3f}/min per instance: "
                         f"{ahead / current:.3f} per instance in "
                         f"{settings.forecast_seconds} s > {ceiling:.3f}")
    breaches: list[str] = []
    unsettled: list[str] = []
    ratios = [1.0]
    prefill_breach = ""
    queue_breach = proportional_breach = False
    for name, value, target in (("TTFT", load.ttft_attainment, targets.ttft_attainment),
                                ("TPOT", load.tpot_attainment, targets.tpot_attainment)):
        if value is not None and 1.0 - value > (1.0 - target) * (1.0 + tolerance):
            (breaches if misses_settled else unsettled).append(
                f"{name} attainment {value:.3f} < {target}")
    for name, value, target, proportional in (
            ("queue delay", load.queue_delay_s, targets.queue_delay_seconds, False),
            ("KV utilisation", load.kv_utilization, targets.kv_utilization, True),
            ("prefill load", load.prefill_load, targets.prefill_load, True)):
        if proportional:
            ratios.append(value / target)
        if value > target * (1.0 + tolerance):
            (breaches if settled or proportional else unsettled).append(
                f"{name} {value:.3f} > {target}")
            if name == "prefill load":
                prefill_breach = breaches[-1]
            proportional_breach |= proportional
            queue_breach |= not proportional and settled
    if unsettled and not breaches and ahead_wanted <= current:
        if settled:  # only the misses wait: the hold after a breach's scale-up
            return current, (f"{'; '.join(unsettled)}, but the queue behind the last breach's "
                             f"scale-up is gone: those misses are its past"), False
        return current, (f"{'; '.join(unsettled)}, but {n} instance(s) have reported for "
                         f"less than {SETTLE_S:.0f} s: waiting for the window to catch up"), False
    if breaches == [prefill_breach] and trend is not None and trend.slope_per_s < 0 \
            and forecast:
        # Only the prefill load is over, and it is clearly falling: by the time a new
        # instance could serve (forecastSeconds) the load is back inside the band, so one
        # started now would only be drained again. (Attainment, queue delay and KV, the
        # signals of an actual shortage, are not overruled; nor is a load that stays over.)
        ahead = trend.at(settings.forecast_seconds)
        if ahead / current <= ceiling:
            return current, (f"{prefill_breach}, but falling "
                             f"{trend.slope_per_s * 60 / n:+.3f}/min per instance: "
                             f"{ahead / current:.3f} per instance in "
                             f"{settings.forecast_seconds} s, before a new one would serve"), False
    if breaches:
        # Instances still starting already count against the shortage: never below current.
        wanted = max(current, n + 1, math.ceil(n * max(ratios)))
        backlogged = queue_breach and proportional_breach
        if backlogged:
            # Over the load band with a queue behind it (a step in load): the instances that
            # hold the queue take little new work until it has drained, which can be long
            # after the new ones serve, and the router sends the least loaded (the new ones)
            # everything meanwhile. So the new ones are sized to carry the load on their own
            # (the module docstring, stage 1); maxStep still caps the step.
            wanted = max(wanted, n + math.ceil(n * max(ratios) - 1e-9))
        if ahead_wanted > wanted:
            return ahead_wanted, ahead_why, wanted > current
        return wanted, "; ".join(breaches), wanted > current
    if ahead_wanted > current:
        return ahead_wanted, ahead_why, False

    # The HPA's hysteresis: the band is around the value now (below target * (1 - tolerance)
    # before any scale-down), and the new count brings the projected value back to the target,
    # not below the band's lower edge. A band on both would keep about a tenth more capacity
    # than the targets ask for, at every count (docs/autoscaling.md, the study).
    prefill = load.prefill_load
    if trend is not None and trend.slope_per_s < 0 and settings.forecast_seconds > 0:
        # Falling clearly: size to the load at the end of the down window, so that the
        # window's highest recommendation is the one the load needs when it ends.
        prefill = min(prefill, trend.at(settings.scale_down_stabilization_seconds) / n)
    elif trend is not None and trend.slope_per_s > 0 and settings.forecast_seconds > 0:
        prefill = max(prefill, trend.at(settings.forecast_seconds) / n)  # no scale-down
    below_band = (load.kv_utilization <= targets.kv_utilization * (1.0 - tolerance)
                  and prefill <= targets.prefill_load * (1.0 - tolerance))

    def holds(m: int) -> bool:
        ratio = n / m
        return (load.kv_utilization * ratio <= targets.kv_utilization
                and prefill * ratio <= targets.prefill_load)

    comfortable = all((
        load.queue_delay_s <= targets.queue_delay_seconds * (1.0 - tolerance),
        load.ttft_attainment is None
        or 1.0 - load.ttft_attainment <= (1.0 - targets.ttft_attainment) * (1.0 - tolerance),
        load.tpot_attainment is None
        or 1.0 - load.tpot_attainment <= (1.0 - targets.tpot_attainment) * (1.0 - tolerance)))
    smallest = next((m for m in range(1, n) if holds(m)), n) if comfortable and below_band else n
    summary = (f"prefill load {load.prefill_load:.2f}"
               + (f" (trend: {prefill:.2f})" if prefill != load.prefill_load else "")
               + f", KV {load.kv_utilization:.2f}, "
               f"queue {load.queue_delay_s:.3f} s")
    if smallest < n:
        return smallest, f"{summary}: {smallest} instance(s) would hold every target", False
    return current, f"{summary}: within targets", False


def stabilise(recommendation: int, current: int, settings: Autoscaling, history: ScaleHistory,
              now_s: float) -> tuple[int, str]:
    """Stage 2: HPA's stabilisation windows over (this and) the recorded recommendations."""
    if recommendation > current:
        window = [r for t, r in history.recommendations
                  if t >= now_s - settings.scale_up_stabilization_seconds] + [recommendation]
        return max(current, min(window)), f"lowest over {settings.scale_up_stabilization_seconds} s"
    if recommendation < current:
        if now_s - history.since_s < settings.scale_down_stabilization_seconds:
            return current, (f"history covers {now_s - history.since_s:.0f} of "
                             f"{settings.scale_down_stabilization_seconds} s")
        window = [r for t, r in history.recommendations
                  if t >= now_s - settings.scale_down_stabilization_seconds] + [recommendation]
        return min(current, max(window)), \
            f"highest over {settings.scale_down_stabilization_seconds} s"
    return current, ""


def decide_scale(signals: ScaleSignals, spec: ServingReplicaSpec, history: ScaleHistory,
                 now_s: float) -> ScaleDecision:
    """One autoscaler step (see the module docstring). ``spec.autoscaling`` must be set."""
    settings = spec.autoscaling
    if settings is None:
        raise ValueError("decide_scale needs spec.autoscaling")
    current = signals.current
    low, high = settings.min_instances, settings.max_instances
    keep_s = max(settings.scale_up_stabilization_seconds,
                 settings.scale_down_stabilization_seconds)
    load = _aggregate(signals.loads) if signals.loads else None
    reporting = len(signals.loads)
    if history.reporting_since_s is None:  # a fresh history: stable as far as it knows
        reporting_since_s = history.since_s
    elif reporting != history.reporting:
        reporting_since_s = now_s
    else:
        reporting_since_s = history.reporting_since_s
    settled = now_s - reporting_since_s >= SETTLE_S
    demand = tuple((t, v) for t, v in history.demand
                   if t > now_s - settings.forecast_window_seconds)
    if load is not None:
        demand += ((now_s, load.prefill_load * load.count),)
    trend = fit_trend(demand, now_s) if settings.forecast_seconds > 0 else None
    # The forecast hold (the comment above OUTCOMES): until the instances reporting have been the
    # same for a whole trend window since the last breach's scale-up.
    hold = history.breach_up is not None and current >= history.breach_up[1] and not (
        reporting_since_s > history.breach_up[0]
        and now_s - reporting_since_s >= settings.forecast_window_seconds)
    breach_up = False
    if load is None:
        recommendation, why = current, "no ready instance reported its load"
    else:
        # During that hold, once the queue is back within its target, missed TTFT or TPOT
        # are the backlog's past (requests that waited in it, finishing now): they ask for
        # no more instances; the queue and the load signals still do.
        queue_gone = load.queue_delay_s <= settings.targets.queue_delay_seconds * (
            1.0 + settings.tolerance)
        recommendation, why, breach_up = recommend(
            load, settings, current, settled, trend, forecast_up=not hold,
            misses_settled=settled and not (hold and queue_gone))
    recorded = tuple((t, r) for t, r in history.recommendations if t >= now_s - keep_s) + \
        ((now_s, recommendation),)
    stabilised, window_note = stabilise(recommendation, current, settings, history, now_s)
    step = max(-settings.max_step, min(settings.max_step, stabilised - current))
    desired = min(high, max(low, current + step))
    if not low <= current <= high:
        desired = min(high, max(low, current))  # the bounds changed: they come first

    if desired > current:
        reason = SCALE_UP
    elif desired < current:
        reason = SCALE_DOWN
    elif load is None:
        reason = NO_SIGNALS
    elif recommendation > current:
        reason = AT_MAX if current >= high else STABILIZING
    elif recommendation < current:
        reason = AT_MIN if current <= low else STABILIZING
    else:
        reason = WITHIN_TARGETS

    add_pools: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    if desired > current:
        add_pools = pools_for_new(signals, spec, desired - current)
    elif desired < current:
        remove = pick_drains(signals, spec, current - desired)
        desired = current - len(remove)
        if not remove:
            reason = AT_MIN
    message = f"{current} -> {desired} instance(s) (recommended {recommendation}"
    message += f", {window_note})" if window_note and recommendation != current else ")"
    message += f": {why}"
    if not low <= current <= high:
        message += f"; bounds are [{low}, {high}]"
    next_breach_up = (now_s, desired) if desired > current and breach_up \
        else history.breach_up if hold else None
    next_history = replace(history, recommendations=recorded,
                           last_scale_s=now_s if desired != current else history.last_scale_s,
                           reporting=reporting, reporting_since_s=reporting_since_s,
                           demand=demand, breach_up=next_breach_up)
    return ScaleDecision(
        current=current, desired=desired, recommendation=recommendation, reason=reason,
        message=message, history=next_history, add_pools=add_pools, remove=remove,
        ttft_attainment=load.ttft_attainment if load else None,
        tpot_attainment=load.tpot_attainment if load else None, trend=trend)


def _as_pool_signals(load: InstanceLoad) -> InstanceSignals:
    return InstanceSignals(instance=load.instance, pool=load.pool,
                           queue_backlog_s=load.queue_delay_s,
                           slo_deviation=load.slo_deviation, utilization=load.busy_fraction)


def pools_for_new(signals: ScaleSignals, spec: ServingReplicaSpec, count: int) -> tuple[str, ...]:
    """Without pools, every instance is unified. With pools, new instances go to the pool
    under the higher P90 pressure (the one the rebalancer would feed); an empty or unknown
    pool comes first."""
    if spec.pools is None:
        return (UNIFIED_POOL,) * count
    pressures = pool_pressures([_as_pool_signals(x) for x in signals.loads],
                               spec.pools.rebalance.weights)
    sizes = {pool: signals.size(pool) for pool in (SHORT, LONG)}
    chosen = []
    for _ in range(count):
        pool = max((SHORT, LONG), key=lambda p: (
            sizes[p] == 0, -math.inf if pressures[p] is None else pressures[p], p == SHORT))
        chosen.append(pool)
        sizes[pool] += 1
    return tuple(chosen)


def pick_drains(signals: ScaleSignals, spec: ServingReplicaSpec, count: int) -> tuple[str, ...]:
    """The ``count`` instances to drain: those still starting first (they serve nothing),
    then the least loaded; with pools, from the less pressured pool while it keeps more than
    minPerPool (else from the other pool)."""
    loads = list(signals.loads)
    floor = 0
    if spec.pools is not None and spec.pools.rebalance.enabled:
        floor = spec.pools.rebalance.min_per_pool
    sizes = {pool: signals.size(pool) for pool in (SHORT, LONG, UNIFIED_POOL)}
    chosen: list[str] = []
    for starting in sorted(signals.starting, key=lambda x: x.instance, reverse=True):
        if len(chosen) < count and sizes[starting.pool] > floor:
            chosen.append(starting.instance)
            sizes[starting.pool] -= 1
    if spec.pools is None:
        ordered = sorted(loads, key=lambda x: (x.queue_delay_s + x.kv_utilization,
                                               x.busy_fraction, x.instance))
        return tuple(chosen + [x.instance for x in ordered[:count - len(chosen)]])
    weights = spec.pools.rebalance.weights
    pressures = pool_pressures([_as_pool_signals(x) for x in loads], weights)
    while len(chosen) < count:
        left = [x for x in loads if x.instance not in chosen and sizes[x.pool] > floor]
        if not left:
            break
        colder = min({x.pool for x in left}, key=lambda p: (pressures.get(p) or 0.0, p))
        victim = min((x for x in left if x.pool == colder),
                     key=lambda x: (instance_pressure(_as_pool_signals(x), weights), x.instance))
        chosen.append(victim.instance)
        sizes[victim.pool] -= 1
    return tuple(chosen)
