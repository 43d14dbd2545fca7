"""The agent's config file of a ServingReplica: the spec's engine-facing fields, in the agent's
own config (``slipstream.agent.config.ServeConfig``), so the operator renders exactly what
``slipstream serve --config`` reads, validated by the same models.

    ServingReplicaSpec --agent_config()--> ServeConfig --.to_yaml(only_set=True)-->
        engine.yaml in the replica's ConfigMap (operator/builders.py), mounted into every
        agent pod --slipstream serve --config--> the same ServeConfig, plus the pod's flags

The file uses the CRD's wire names (camelCase, the CRD's section names), the same as
``kubectl get sr -o yaml`` shows, and holds only what the spec sets: the agent's defaults
fill the rest. The rendered text is the one the operator wrote before the agent had one
config, so an operator upgrade changes no template hash and restarts no pod.
"""

from __future__ import annotations

from typing import Any

from slipstream.agent.config.serve_config import ServeConfig
from slipstream.crds.servingreplica import ServingReplicaSpec


def agent_config(spec: ServingReplicaSpec, model_path: str) -> ServeConfig:
    """What every agent of the replica reads at start. The per-pod settings (the role, the
    ports, the address) are flags and environment variables the pod adds."""
    model: dict[str, Any] = {"name": spec.model.name, "path": model_path,
                             "dtype": spec.model.dtype}
    # Written only when not the default, so existing replicas' files (and template hashes)
    # did not change when the fields came.
    if spec.model.quantization != "auto":
        model["quantization"] = spec.model.quantization
    if spec.model.quantization_group_size != 64:
        model["quantizationGroupSize"] = spec.model.quantization_group_size
    if spec.model.max_model_len is not None:
        model["maxModelLen"] = spec.model.max_model_len
    server: dict[str, Any] = {"drainTimeoutSeconds": spec.drain_timeout_seconds}
    if spec.single_process:  # written only when true, for the same reason
        server["singleProcess"] = True
    tree: dict[str, Any] = {"model": model, "parallelism": spec.parallelism.to_api(),
                            "scheduler": spec.scheduler.to_api(), "slo": spec.slo.to_api(),
                            "server": server}
    if spec.pools is not None:
        tree["pools"] = {"longPrefillThresholdTokens":
                         spec.pools.long_prefill_threshold_tokens}
    if spec.disaggregation is not None:
        # The role is per pod ($SLIPSTREAM_ROLE, set by the operator).
        tree["disaggregation"] = {
            "transport": spec.disaggregation.transport,
            "holdTimeoutSeconds": spec.disaggregation.hold_timeout_seconds,
            "blocksPerRead": spec.disaggregation.blocks_per_read}
    if spec.kv_tiers is not None:
        tree["kvTiers"] = spec.kv_tiers.to_api()
    return ServeConfig.from_layers(tree)
