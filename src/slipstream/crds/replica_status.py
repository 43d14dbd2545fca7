"""``status`` of a ServingReplica: what the operator writes back (phase, conditions, instances
and their ranks, pools, autoscaling, disaggregation) and ``kubectl get sr`` prints.

Written by the operator only (operator/status.py builds it); reading it back ignores fields
from other writers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from slipstream.crds.base import ApiModel


class StatusModel(ApiModel):
    # The operator reads back what it wrote; fields from other writers are not its business.
    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    """The shape of metav1.Condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RankStatus(StatusModel):
    rank: int = Field(description="Index of the pod (node share) in its instance; 0 leads.")
    node: str
    pod: str
    gpus: int


class InstanceStatus(StatusModel):
    name: str
    pool: str
    ready: bool
    role: str | None = Field(None, description="prefill or decode (spec.disaggregation); "
                             "absent for mixed instances.")
    ranks: list[RankStatus] = Field(default_factory=list)


class PoolPressure(StatusModel):
    short: float | None = None
    long: float | None = None


class PoolsStatus(StatusModel):
    short: int
    long: int
    pressure: PoolPressure | None = None
    last_rebalance_time: str | None = None


class RoleStatus(StatusModel):
    instances: int = Field(description="Instances of this role placed.")
    ready_instances: int
    ready: str = Field(description="Ready/desired instances of this role, for kubectl get.")


class DisaggregationStatus(StatusModel):
    prefill: RoleStatus
    decode: RoleStatus


class AutoscalingStatus(StatusModel):
    desired_instances: int = Field(description="The count the autoscaler last decided.")
    current_instances: int = Field(description="Instances serving or starting when it "
                                   "decided (draining ones not counted).")
    last_scale_reason: str | None = Field(None, description="The reason of the last decision.")
    last_scale_message: str | None = None
    last_scale_time: str | None = Field(None, description="When the count last changed.")
    add_pools: list[str] = Field(
        default_factory=list, description="With pools: the pool of each instance the last "
        "scale-up added, in order (the one under the higher pressure); reconcile creates "
        "them there.")


class ServingReplicaStatus(StatusModel):
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"] | None = None
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int | None = Field(None, description="Instances placed (scale subresource).")
    ready_instances: int | None = None
    ready: str | None = Field(None, description="Ready/desired instances, for kubectl get.")
    selector: str | None = Field(None, description="Label selector of the agent pods (scale "
                                 "subresource).")
    instances: list[InstanceStatus] = Field(default_factory=list)
    pools: PoolsStatus | None = None
    autoscaling: AutoscalingStatus | None = None
    disaggregation: DisaggregationStatus | None = None
    endpoint: str | None = None
