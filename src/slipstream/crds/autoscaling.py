"""``spec.autoscaling`` of a ServingReplica: the built-in SLO autoscaler's settings and the
targets it holds the replica to. The decisions themselves are ``slipstream.decisions.autoscale``;
the CEL rules here are checked by the API server.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from slipstream.crds.base import ApiModel
from slipstream.crds.cel import Rule, non_negative, positive, rules, share


class AutoscalingTargets(ApiModel):
    """What the autoscaler holds the replica to. Scale-up when any is breached beyond the
    tolerance; scale-down only when all hold with room to spare on fewer instances."""

    ttft_attainment: float = Field(
        0.95, description="Fraction of first tokens within spec.slo.ttftSeconds over the "
        "agents' load window (30 s) below which to scale up.",
        json_schema_extra=rules(share("spec.autoscaling.targets.ttftAttainment")))
    tpot_attainment: float = Field(
        0.95, description="Fraction of finished requests within spec.slo.tpotMilliseconds "
        "over the load window below which to scale up.",
        json_schema_extra=rules(share("spec.autoscaling.targets.tpotAttainment")))
    queue_delay_seconds: float = Field(
        0.5, description="Mean seconds of queued prefill work per instance to hold below.",
        json_schema_extra=rules(positive("spec.autoscaling.targets.queueDelaySeconds",
                                         "seconds", number=True)))
    kv_utilization: float = Field(
        0.8, description="Mean fraction of KV-cache blocks in use to hold below.",
        json_schema_extra=rules(share("spec.autoscaling.targets.kvUtilization")))
    prefill_load: float = Field(
        0.67, description="Mean seconds of prefill work arriving per second on each instance "
        "(prompt tokens arriving over the recent prefill rate) to hold below: the load signal "
        "that grows in proportion to the arrival rate, so the one that says how many "
        "instances fewer would still do.",
        json_schema_extra=rules(positive("spec.autoscaling.targets.prefillLoad",
                                         number=True)))


class Autoscaling(ApiModel):
    """The built-in autoscaler. While enabled it owns the instance count and spec.instances
    is ignored (HPA or KEDA through the scale subresource are the alternative: leave this
    disabled for them)."""

    model_config = ConfigDict(json_schema_extra=rules(
        Rule("self.minInstances <= self.maxInstances",
             "spec.autoscaling.minInstances must not exceed spec.autoscaling.maxInstances",
             field_path=".minInstances"),
        Rule("self.scaleDownStabilizationSeconds >= self.periodSeconds",
             "spec.autoscaling.scaleDownStabilizationSeconds must be at least "
             "spec.autoscaling.periodSeconds", field_path=".scaleDownStabilizationSeconds")))

    enabled: bool = True
    min_instances: int = Field(1, json_schema_extra=rules(Rule(
        "self >= 1", "spec.autoscaling.minInstances must be at least 1")))
    max_instances: int = Field(json_schema_extra=rules(Rule(
        "self >= 1", "spec.autoscaling.maxInstances must be at least 1")))
    period_seconds: int = Field(15, description="How often the autoscaler decides.",
                                json_schema_extra=rules(
                                    positive("spec.autoscaling.periodSeconds", "seconds")))
    scale_up_stabilization_seconds: int = Field(
        0, description="Scale up only to the lowest count recommended over this window (0, "
        "as the HPA: at once; new instances take minutes to serve anyway).",
        json_schema_extra=rules(non_negative("spec.autoscaling.scaleUpStabilizationSeconds")))
    scale_down_stabilization_seconds: int = Field(
        300, description="Scale down only to the highest count recommended over this window.",
        json_schema_extra=rules(non_negative("spec.autoscaling.scaleDownStabilizationSeconds")))
    max_step: int = Field(2, description="Most instances added or removed in one decision.",
                          json_schema_extra=rules(positive("spec.autoscaling.maxStep")))
    tolerance: float = Field(0.1, description="Relative band around each target inside which "
                             "nothing changes (hysteresis).", json_schema_extra=rules(Rule(
                                 "self >= 0.0 && self < 1.0",
                                 "spec.autoscaling.tolerance must be within [0, 1)")))
    forecast_seconds: int = Field(
        75, description="How far ahead the autoscaler looks: when the replica's prefill load "
        "has a clear trend over forecastWindowSeconds, a scale-up is sized to the trend "
        "extrapolated this far (a new instance's startup plus a period), and a scale-down to "
        "the trend at the end of the scale-down window. A flat or noisy load has no clear "
        "trend and changes nothing. 0 turns the forecast off.",
        json_schema_extra=rules(non_negative("spec.autoscaling.forecastSeconds")))
    forecast_window_seconds: int = Field(
        120, description="The recent history the load trend is fitted over.",
        json_schema_extra=rules(Rule(
            "self >= 30", "spec.autoscaling.forecastWindowSeconds must be at least 30")))
    targets: AutoscalingTargets = Field(default_factory=AutoscalingTargets)
