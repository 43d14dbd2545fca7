"""What the decide_scale tests share: a spec with autoscaling, instance loads, and a loop that
drives decide_scale the way the operator does."""

from __future__ import annotations

from slipstream.crds.servingreplica import ServingReplicaSpec
from slipstream.decisions.autoscale import decide_scale
from slipstream.decisions.scale_signals import InstanceLoad, ScaleHistory, ScaleSignals

BASE = {"model": {"name": "m", "source": {"hostPath": {"path": "/m"}}}, "image": "agent:1"}


def make_spec(pools: dict | None = None, **autoscaling) -> ServingReplicaSpec:
    settings_ = {"minInstances": 1, "maxInstances": 8, "periodSeconds": 10,
                 "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 60,
                 "maxStep": 2, "targets": {"prefillLoad": 0.6}, **autoscaling}
    body = {**BASE, "autoscaling": settings_}
    if pools is not None:
        body["pools"] = pools
    return ServingReplicaSpec.model_validate(body)


SPEC = make_spec()
LONG_AGO = ScaleHistory(since_s=-10_000.0)


def load(name: str, *, pool: str = "unified", busy: float = 0.5, kv: float = 0.1,
         queue_s: float = 0.0, ttft: tuple[int, int] = (0, 0), tpot: tuple[int, int] = (0, 0),
         deviation: float = 0.0) -> InstanceLoad:
    return InstanceLoad(instance=name, pool=pool, first_tokens=ttft[1], ttft_met=ttft[0],
                        finished=tpot[1], tpot_met=tpot[0], queue_delay_s=queue_s,
                        kv_utilization=kv, busy_fraction=busy, prefill_load=busy,
                        slo_deviation=deviation)


def fleet(count: int, **kwargs) -> ScaleSignals:
    return ScaleSignals(loads=tuple(load(f"i{k}", **kwargs) for k in range(count)))


def run(signals_at, spec=SPEC, steps=30, period_s=10.0, start=2,
        history: ScaleHistory = LONG_AGO):
    """Drive decide_scale like the operator: ``signals_at(step, count)`` gives the signals of
    ``count`` instances; the count follows each decision at once. Returns the counts."""
    count, counts = start, []
    for step in range(steps):
        decision = decide_scale(signals_at(step, count), spec, history, step * period_s)
        history = decision.history
        count = decision.desired
        counts.append(count)
    return counts
