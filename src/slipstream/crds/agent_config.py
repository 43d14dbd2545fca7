"""The agent's configuration file: the engine-facing part of a ServingReplica, in the CRD's own
models, so there is one path from the spec to the engine.

    ServingReplicaSpec --AgentConfig.from_spec()--> engine.yaml in the replica's ConfigMap
        (operator/builders.py), mounted into every agent pod
    engine.yaml --slipstream serve --config--> the serve flags' defaults (server/cli_configs.py)
        --> EngineConfig, SchedulerConfig, ServerConfig

The file uses the CRD's wire names (camelCase), the same as ``kubectl get sr -o yaml`` shows,
and can be written by hand for a local ``slipstream serve``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import Field

from slipstream.crds.base import ApiModel
from slipstream.crds.servingreplica import (
    DEFAULT_DRAIN_TIMEOUT_SECONDS, KVTiers, Parallelism, SchedulerSpec, ServingReplicaSpec, Slo)

T = TypeVar("T")


class AgentModel(ApiModel):
    name: str = Field(min_length=1, description="The model id clients send.")
    path: str = Field(min_length=1, description="The model's directory as the agent sees it.")
    dtype: str = "auto"
    # Written only when not the default, so existing replicas' files (and template hashes)
    # did not change when the fields came.
    quantization: str | None = None
    quantization_group_size: int | None = None
    max_model_len: int | None = None


class AgentPools(ApiModel):
    long_prefill_threshold_tokens: int = Field(8192, gt=0)


class AgentDisaggregation(ApiModel):
    """The KV transfer settings shared by both roles; the role itself is per pod
    ($SLIPSTREAM_ROLE, set by the operator)."""

    transport: str = "mooncake"
    hold_timeout_seconds: float = Field(120.0, gt=0)
    blocks_per_read: int = Field(8, ge=1)


class AgentServer(ApiModel):
    drain_timeout_seconds: float = Field(DEFAULT_DRAIN_TIMEOUT_SECONDS, ge=0, le=3600)
    # True: `slipstream serve --single-process`. Written only when true, so the files (and
    # the template hashes) of replicas that keep the default layout did not change when the
    # field came, and an operator upgrade restarts nothing.
    single_process: bool | None = None


class AgentConfig(ApiModel):
    model: AgentModel
    parallelism: Parallelism = Field(default_factory=Parallelism)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    slo: Slo = Field(default_factory=Slo)
    pools: AgentPools | None = None
    server: AgentServer = Field(default_factory=AgentServer)
    disaggregation: AgentDisaggregation | None = None
    kv_tiers: KVTiers | None = None

    @classmethod
    def from_spec(cls, spec: ServingReplicaSpec, model_path: str) -> AgentConfig:
        pools = None
        if spec.pools is not None:
            pools = AgentPools(
                long_prefill_threshold_tokens=spec.pools.long_prefill_threshold_tokens)
        return cls(model=AgentModel(name=spec.model.name, path=model_path,
                                    dtype=spec.model.dtype,
                                    quantization=_unless(spec.model.quantization, "auto"),
                                    quantization_group_size=_unless(
                                        spec.model.quantization_group_size, 64),
                                    max_model_len=spec.model.max_model_len),
                   parallelism=spec.parallelism, scheduler=spec.scheduler, slo=spec.slo,
                   pools=pools,
                   server=AgentServer(drain_timeout_seconds=spec.drain_timeout_seconds,
                                      single_process=spec.single_process or None),
                   disaggregation=_disaggregation(spec), kv_tiers=spec.kv_tiers)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_api(), sort_keys=True)

    @classmethod
    def from_file(cls, path: Path) -> AgentConfig:
        """Raises OSError, or ValueError (pydantic's ValidationError is one) naming the field."""
        try:
            tree = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as error:
            raise ValueError(f"not YAML: {error}") from None
        return cls.model_validate(tree or {})


def _unless(value: T, default: T) -> T | None:
    return None if value == default else value


def _disaggregation(spec: ServingReplicaSpec) -> AgentDisaggregation | None:
    if spec.disaggregation is None:
        return None
    return AgentDisaggregation(transport=spec.disaggregation.transport,
                               hold_timeout_seconds=spec.disaggregation.hold_timeout_seconds,
                               blocks_per_read=spec.disaggregation.blocks_per_read)
