"""The ServingReplica API (group ``slipstream.dev``, version ``v1alpha1``): the source of truth.

    these pydantic models --crds/generate.py--> CRD YAML (crds/, charts/slipstream/crds/)
    kube-apiserver (defaults + CEL rules) --stored object--> operator: ServingReplicaSpec.parse

This module holds the spec (``ServingReplicaSpec`` and its parts, and the rules that span
them); ``spec.autoscaling`` is in ``autoscaling.py``, the status the operator writes in
``replica_status.py``, and the camelCase base model in ``base.py``.

Python names are snake_case with units; the wire names are their camelCase aliases, which is
what users write and what the CEL rules (``self.placement.gpusPerNode``) see. The API server
enforces the rules, so the operator trusts a stored spec; ``model_validate`` still checks types.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field

from slipstream.agent.scheduler.config import (
    AWD_SHORTEST_BUCKET_TOKENS, POLICY_NAMES, PREEMPTION_MODES, SHORT_PREFILL_BATCHING_MODES)
from slipstream.crds.autoscaling import Autoscaling
from slipstream.crds.base import ApiModel
from slipstream.crds.cel import Rule, non_negative, one_of, positive, power_of_two, rules

GROUP = "slipstream.dev"
VERSION = "v1alpha1"
KIND = "ServingReplica"
PLURAL = "servingreplicas"
SINGULAR = "servingreplica"
SHORT_NAMES = ("sr",)

# The agent's own lists, so the API accepts exactly what `slipstream serve` does.
SCHEDULER_POLICIES = POLICY_NAMES
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
POOL_NAMES = ("short", "long")
# AWD's longest length bucket: a power of two from the shortest bucket up to 8192 tokens.
SHORT_PREFILL_PROMPT_LIMITS = tuple(AWD_SHORTEST_BUCKET_TOKENS << i for i in range(11))
DEFAULT_DRAIN_TIMEOUT_SECONDS = 30  # as `slipstream serve --drain-timeout-s`
UNIFIED_POOL = "unified"  # the pool label of every instance when spec.pools is absent
# The pool label of decode instances (spec.disaggregation); the router chains prefill
# instances (short/long/unified) to them.
DECODE_POOL = "decode"
PREFILL_ROLE, DECODE_ROLE = "prefill", "decode"
# `slipstream serve --kv-transport` (agent/engine/disagg_config.py; the operator may not import
# the engine, a unit test keeps the two lists equal).
KV_TRANSPORTS = ("mooncake", "zmq")
# `--kv-host-memory` / `--kv-disk-size` (agent/engine/kv/tier_settings.py SIZE_PATTERN; a unit
# test keeps the two equal), escaped for a CEL string literal.
KV_SIZE_PATTERN = r"^[0-9]+(\\.[0-9]+)?(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$"


# -- spec ---------------------------------------------------------------------------------------

class HostPathSource(ApiModel):
    path: str = Field(min_length=1, description="Directory on every GPU node holding the "
                      "Hugging Face model (config.json, *.safetensors, tokenizer.json).")


class PvcSource(ApiModel):
    claim_name: str = Field(min_length=1, description="PersistentVolumeClaim with the model.")
    sub_path: str = Field("", description="Directory of the model inside the volume.")


class ModelSource(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules(Rule(
        "has(self.hostPath) != has(self.pvc)",
        "spec.model.source must set exactly one of hostPath or pvc")))

    host_path: HostPathSource | None = None
    pvc: PvcSource | None = None


class ModelSpec(ApiModel):
    name: str = Field(min_length=1, description="The model id clients send (served model name).")
    source: ModelSource
    dtype: str = Field("auto", max_length=16, json_schema_extra=rules(one_of("spec.model.dtype", DTYPES)))
    quantization: str = Field(
        "auto", max_length=16,
        description="Weight format: auto (a GGUF's own blocks, a quantized checkpoint as "
                    "stored, else the checkpoint's floats), none, or int8/int4/fp8 to quantize "
                    "a float checkpoint at load (weights only). A format the GPU cannot run "
                    "fails the agent at start-up.",
        json_schema_extra=rules(one_of("spec.model.quantization", QUANTIZATIONS)))
    quantization_group_size: int = Field(
        64, description="int4's group of input weights sharing a scale and minimum.",
        json_schema_extra=rules(Rule("self in [32, 64, 128]",
                                     "spec.model.quantizationGroupSize must be one of: 32, "
                                     "64, 128")))
    max_model_len: int | None = Field(None, description="Context length in tokens (prompt + "
                                      "output); default: the model's maximum.",
                                      json_schema_extra=rules(positive("spec.model.maxModelLen",
                                                                       "tokens")))


class Parallelism(ApiModel):
    tp: int = Field(1, description="Tensor-parallel degree; a TP group stays inside one node.",
                    json_schema_extra=rules(power_of_two("spec.parallelism.tp")))
    spp: int = Field(1, description="Stream-pipeline-parallel stages; may span nodes.",
                     json_schema_extra=rules(power_of_two("spec.parallelism.spp")))
    kvp: int = Field(1, description="KV-cache-parallel groups; may span nodes.",
                     json_schema_extra=rules(power_of_two("spec.parallelism.kvp")))
    # Written only when set (ApiModel drops None), so replicas without it keep their agent
    # config and template hash.
    ep: int | None = Field(None, description="Expert-parallel degree for mixture-of-experts "
                           "models: each rank holds 1/ep of the experts (attention is "
                           "replicated); an EP group of tp x ep GPUs stays inside one node. "
                           "Combines with spp and kvp. The agent refuses a dense model or "
                           "an expert count ep does not divide.",
                           json_schema_extra=rules(power_of_two("spec.parallelism.ep")))
    kvp_tokens_per_group: int = Field(
        1_048_576, description="Tokens one KVP group holds before a request takes the next.",
        json_schema_extra=rules(Rule(
            "self > 0 && self % 16 == 0",
            "spec.parallelism.kvpTokensPerGroup must be a positive multiple of the 16-token "
            "KV block")))

    @property
    def expert_parallel(self) -> int:
        return self.ep or 1

    @property
    def gpus_per_instance(self) -> int:
        return self.tp * self.expert_parallel * self.spp * self.kvp


class Toleration(ApiModel):
    key: str | None = None
    operator: str | None = Field(None, max_length=16, json_schema_extra=rules(one_of(
        "spec.placement.tolerations[].operator", ("Exists", "Equal"))))
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None


class Placement(ApiModel):
    gpus_per_node: int = Field(8, description="GPUs on each node this replica may use.",
                               json_schema_extra=rules(positive("spec.placement.gpusPerNode")))
    gpu_resource: str = Field("nvidia.com/gpu", max_length=253, description="Extended resource name of a GPU.",
                              json_schema_extra=rules(Rule(
                                  "self.contains('/')",
                                  "spec.placement.gpuResource must be an extended resource name "
                                  "such as nvidia.com/gpu")))
    node_selector: dict[str, str] = Field(default_factory=dict, description="Only nodes with "
                                          "these labels (for example a GPU product) are used.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)


class RebalanceWeights(ApiModel):
    """PLA-Serve's (alpha, beta, gamma): pressure = a*queue + b*sloDeviation - g*utilization."""

    queue: float = Field(1.0, json_schema_extra=rules(
        non_negative("spec.pools.rebalance.weights.queue", number=True)))
    slo_deviation: float = Field(1.0, json_schema_extra=rules(
        non_negative("spec.pools.rebalance.weights.sloDeviation", number=True)))
    utilization: float = Field(0.25, json_schema_extra=rules(
        non_negative("spec.pools.rebalance.weights.utilization", number=True)))


class Rebalance(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules(Rule(
        "self.cooldownSeconds >= self.periodSeconds",
        "spec.pools.rebalance.cooldownSeconds must be at least periodSeconds",
        field_path=".cooldownSeconds")))

    enabled: bool = True
    period_seconds: int = Field(30, json_schema_extra=rules(
        positive("spec.pools.rebalance.periodSeconds", "seconds")))
    cooldown_seconds: int = Field(120, json_schema_extra=rules(
        positive("spec.pools.rebalance.cooldownSeconds", "seconds")))
    hysteresis: float = Field(0.2, description="Relative pressure gap that must be exceeded "
                              "before an instance moves.", json_schema_extra=rules(
                                  non_negative("spec.pools.rebalance.hysteresis", number=True)))
    min_per_pool: int = Field(1, json_schema_extra=rules(
        non_negative("spec.pools.rebalance.minPerPool")))
    weights: RebalanceWeights = Field(default_factory=RebalanceWeights)


class Pools(ApiModel):
    long_prefill_threshold_tokens: int = Field(
        8192, description="Prompts this long or longer go to the long pool.",
        json_schema_extra=rules(positive("spec.pools.longPrefillThresholdTokens", "tokens")))
    short: int = Field(description="Initial number of short-pool instances; the rest are long.",
                       json_schema_extra=rules(non_negative("spec.pools.short")))
    rebalance: Rebalance = Field(default_factory=Rebalance)


class SchedulerSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules(Rule(
        "self.shortPrefillMaxHeadWaitMs >= self.shortPrefillMaxWaitMs",
        "spec.scheduler.shortPrefillMaxHeadWaitMs must be at least "
        "spec.scheduler.shortPrefillMaxWaitMs", field_path=".shortPrefillMaxHeadWaitMs")))

    policy: str = Field("lars", max_length=16, json_schema_extra=rules(
        one_of("spec.scheduler.policy", SCHEDULER_POLICIES)))
    target_batch_time_ms: float | None = Field(
        None, description="Iteration time budget of the time-budget packer. Unset: the TPOT "
        "SLO, else 50 ms, raised for a model too slow for 50 ms on its device to twice its "
        "128-token prefill.", json_schema_extra=rules(
            positive("spec.scheduler.targetBatchTimeMs", "ms", number=True)))
    max_space_share_fraction: float = Field(0.5, json_schema_extra=rules(Rule(
        "self >= 0.0 && self <= 1.0",
        "spec.scheduler.maxSpaceShareFraction must be within [0, 1]")))
    long_request_threshold_tokens: int = Field(262_144, json_schema_extra=rules(
        positive("spec.scheduler.longRequestThresholdTokens", "tokens")))
    preemption: str = Field("recompute", max_length=16, json_schema_extra=rules(
        one_of("spec.scheduler.preemption", PREEMPTION_MODES)))
    prefix_caching: bool = Field(
        True, description="Reuse the KV of prompt prefixes computed before (content-addressed "
        "blocks kept until memory is needed); false recomputes every prompt in full.")
    short_prefill_batching: str = Field(
        "off", max_length=8, description="awd: hold short prompts briefly and prefill them in "
        "groups (PLA-Serve Adaptive Wait-Depth); meant for the short pool.",
        json_schema_extra=rules(one_of("spec.scheduler.shortPrefillBatching",
                                       SHORT_PREFILL_BATCHING_MODES)))
    short_prefill_max_prompt_tokens: int = Field(
        256, description="Longest prompt AWD holds; its length buckets are 8, 16, ... this.",
        json_schema_extra=rules(Rule(
            f"self in [{', '.join(str(n) for n in SHORT_PREFILL_PROMPT_LIMITS)}]",
            f"spec.scheduler.shortPrefillMaxPromptTokens must be a power of two from "
            f"{SHORT_PREFILL_PROMPT_LIMITS[0]} to {SHORT_PREFILL_PROMPT_LIMITS[-1]}")))
    short_prefill_max_wait_ms: float = Field(
        20.0, description="Longest an AWD group waits to fill.",
        json_schema_extra=rules(
            non_negative("spec.scheduler.shortPrefillMaxWaitMs", number=True)))
    short_prefill_max_head_wait_ms: float = Field(
        50.0, description="No prompt is held by AWD longer than this.",
        json_schema_extra=rules(
            non_negative("spec.scheduler.shortPrefillMaxHeadWaitMs", number=True)))


class Slo(ApiModel):
    ttft_seconds: float | None = Field(None, json_schema_extra=rules(
        positive("spec.slo.ttftSeconds", "seconds", number=True)))
    tpot_milliseconds: float | None = Field(None, json_schema_extra=rules(
        positive("spec.slo.tpotMilliseconds", "ms", number=True)))
    # Below 1: the burn-rate alerts divide by the error budget, 1 - target.
    attainment_target: float = Field(0.99, json_schema_extra=rules(Rule(
        "self > 0.0 && self < 1.0", "spec.slo.attainmentTarget must be within (0, 1)")))


class TenantsRef(ApiModel):
    secret_name: str = Field(
        min_length=1, max_length=253,
        description="A Secret in the replica's namespace whose key `tenants.yaml` is the "
        "tenants file (docs/tenancy.md): API keys as SHA-256 digests, fair-share weights, SLO "
        "classes and limits. The agents and the router mount it and require API keys; a "
        "changed Secret is picked up without a restart.")


class PrefillRole(ApiModel):
    instances: int = Field(description="Prefill instances: they compute prompts and first "
                           "tokens (split into short/long pools by spec.pools, if set).",
                           json_schema_extra=rules(positive(
                               "spec.disaggregation.prefill.instances")))


class DecodeRole(ApiModel):
    instances: int = Field(description="Decode instances: they fetch a prompt's KV from a "
                           "prefill instance and generate the rest.",
                           json_schema_extra=rules(positive(
                               "spec.disaggregation.decode.instances")))


class Disaggregation(ApiModel):
    """Prefill/decode disaggregation (docs/disaggregation.md): the router sends each request
    to a prefill instance, then to a decode instance that pulls the KV."""

    prefill: PrefillRole
    decode: DecodeRole
    transport: str = Field("mooncake", max_length=16, description="How KV moves: mooncake "
                           "(Mooncake Transfer Engine: TCP, or RDMA on GPU hosts) or zmq (over "
                           "the ZeroMQ side channel).", json_schema_extra=rules(one_of(
                               "spec.disaggregation.transport", KV_TRANSPORTS)))
    hold_timeout_seconds: int = Field(
        120, description="A prefill instance frees KV no decode instance fetched after this "
        "long.", json_schema_extra=rules(positive("spec.disaggregation.holdTimeoutSeconds",
                                                  "seconds")))
    blocks_per_read: int = Field(
        8, description="KV blocks a decode instance fetches per transfer-engine read.",
        json_schema_extra=rules(positive("spec.disaggregation.blocksPerRead")))

    @property
    def instances(self) -> int:
        return self.prefill.instances + self.decode.instances


class KVTiers(ApiModel):
    """Host-memory and disk tiers under each agent's prefix cache (docs/kv-tiers.md): KV
    evicted from the GPU is kept there and loaded back for a later prompt with its prefix."""

    host_memory: str = Field(
        description="Host memory per instance for KV blocks evicted from the GPU (pinned), "
        "e.g. 1TiB; `slipstream serve --kv-host-memory`.", max_length=32,
        json_schema_extra=rules(Rule(f"self.matches('{KV_SIZE_PATTERN}')",
                                     "spec.kvTiers.hostMemory must be a size with a unit "
                                     "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512GiB")))
    disk_path: str | None = Field(
        None, max_length=256, description="Directory of the disk tier inside the agent pod "
        "(an emptyDir of diskSize is mounted there); needs diskSize.",
        json_schema_extra=rules(Rule("self.startsWith('/')",
                                     "spec.kvTiers.diskPath must be an absolute path")))
    disk_size: str | None = Field(
        None, max_length=32, description="Most the disk tier may hold, e.g. 2TiB.",
        json_schema_extra=rules(Rule(f"self.matches('{KV_SIZE_PATTERN}')",
                                     "spec.kvTiers.diskSize must be a size with a unit "
                                     "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 2TiB")))


# spec.instances is ignored while autoscaling (the rules on it hold against minInstances).
_AUTOSCALED = "(has(self.autoscaling) && self.autoscaling.enabled)"
# The instances that prefill pools split: with disaggregation the prefill role's, else all.
_PREFILL_INSTANCES = ("(has(self.disaggregation) ? self.disaggregation.prefill.instances : "
                      "self.instances)")

_SPEC_RULES = rules(
    Rule("self.parallelism.tp <= self.placement.gpusPerNode",
         "spec.parallelism.tp must not exceed spec.placement.gpusPerNode: a TP group never "
         "spans nodes", field_path=".parallelism.tp"),
    # Every sparse layer all-reduces over the EP group, so it stays on one node like TP.
    Rule("!has(self.parallelism.ep) || "
         "self.parallelism.tp * self.parallelism.ep <= self.placement.gpusPerNode",
         "spec.parallelism.tp x spec.parallelism.ep must not exceed "
         "spec.placement.gpusPerNode: an expert-parallel group never spans nodes",
         field_path=".parallelism.ep"),
    Rule("!has(self.pools) || " + _AUTOSCALED + " || "
         "self.pools.short <= " + _PREFILL_INSTANCES,
         "spec.pools.short must not exceed spec.instances, or with spec.disaggregation "
         "spec.disaggregation.prefill.instances (the long pool gets the rest)",
         field_path=".pools.short"),
    Rule("!has(self.pools) || !self.pools.rebalance.enabled || "
         "(self.pools.short >= self.pools.rebalance.minPerPool && "
         "(" + _AUTOSCALED + " || "
         + _PREFILL_INSTANCES + " - self.pools.short >= self.pools.rebalance.minPerPool))",
         "spec.pools.short and the long pool (spec.instances, or with spec.disaggregation "
         "its prefill.instances, minus short) must each hold at least "
         "spec.pools.rebalance.minPerPool instances when rebalancing is enabled",
         field_path=".pools.short"),
    # While autoscaling, spec.instances is ignored and the count starts at minInstances, so
    # the pool rules above are checked against minInstances too.
    Rule("!has(self.autoscaling) || !self.autoscaling.enabled || !has(self.pools) || "
         "self.pools.short <= self.autoscaling.minInstances",
         "spec.pools.short must not exceed spec.autoscaling.minInstances while autoscaling",
         field_path=".pools.short"),
    Rule("!has(self.autoscaling) || !self.autoscaling.enabled || !has(self.pools) || "
         "!self.pools.rebalance.enabled || "
         "self.autoscaling.minInstances - self.pools.short >= self.pools.rebalance.minPerPool",
         "spec.autoscaling.minInstances must leave the long pool (minInstances - "
         "spec.pools.short) at least spec.pools.rebalance.minPerPool instances",
         field_path=".autoscaling.minInstances"),
    Rule("!has(self.pools) || self.scheduler.shortPrefillBatching == 'off' || "
         "self.scheduler.shortPrefillMaxPromptTokens < self.pools.longPrefillThresholdTokens",
         "spec.scheduler.shortPrefillMaxPromptTokens must be below "
         "spec.pools.longPrefillThresholdTokens, so that AWD only ever holds the short pool's "
         "prompts", field_path=".scheduler.shortPrefillMaxPromptTokens"),
    Rule("!has(self.disaggregation) || !" + _AUTOSCALED,
         "spec.autoscaling cannot be enabled with spec.disaggregation: size the roles with "
         "spec.disaggregation.prefill.instances and spec.disaggregation.decode.instances",
         field_path=".autoscaling"),
    # The agent's prefill and decode roles keep the KV in the controller process.
    Rule("!has(self.kvTiers) || (has(self.kvTiers.diskPath) == has(self.kvTiers.diskSize))",
         "spec.kvTiers.diskPath and spec.kvTiers.diskSize go together",
         field_path=".kvTiers"),
    Rule("!has(self.kvTiers) || (!has(self.disaggregation) && self.parallelism.tp == 1 && "
         "self.parallelism.spp == 1 && self.parallelism.kvp == 1 && "
         "(!has(self.parallelism.ep) || self.parallelism.ep == 1))",
         "spec.kvTiers needs spec.parallelism.tp, ep, spp and kvp of 1 and no "
         "spec.disaggregation (KV tiers run in single-process agents for now)",
         field_path=".kvTiers"),
    Rule("!has(self.disaggregation) || "
         "(self.parallelism.tp == 1 && self.parallelism.spp == 1 && self.parallelism.kvp == 1 "
         "&& (!has(self.parallelism.ep) || self.parallelism.ep == 1))",
         "spec.disaggregation needs spec.parallelism.tp, ep, spp and kvp of 1 (prefill and "
         "decode "
         "instances run without worker processes for now)", field_path=".disaggregation"),
)


class ServingReplicaSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=_SPEC_RULES)

    model: ModelSpec
    image: str = Field(min_length=1, description="Agent container image.")
    instances: int = Field(1, ge=0, description="Serving instances (scale subresource); each "
                           "is tp x spp x kvp GPUs. Ignored while spec.autoscaling is "
                           "enabled or spec.disaggregation is set.")
    parallelism: Parallelism = Field(default_factory=Parallelism)
    placement: Placement = Field(default_factory=Placement)
    pools: Pools | None = Field(None, description="Optional short/long prefill pools "
                                "(PLA-Serve); absent means every instance serves all lengths.")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    slo: Slo = Field(default_factory=Slo)
    drain_timeout_seconds: int = Field(
        DEFAULT_DRAIN_TIMEOUT_SECONDS, ge=0, le=3600,
        description="On shutdown (rollout, scale-down, rebalance) an instance stops taking "
                    "requests and gives those in flight this long to finish; the rest end with "
                    "an error. The pods' terminationGracePeriodSeconds is set above it.")
    single_process: bool = Field(
        False, description="Run each instance's engine (scheduler, KV cache, model or worker "
        "controller) on a thread of the agent's HTTP server process (`slipstream serve "
        "--single-process`). Default false: the engine runs in an engine-core process of its "
        "own, so HTTP, tokenization and detokenization never stretch its steps.")
    autoscaling: Autoscaling | None = Field(None, description="The built-in SLO autoscaler; "
                                            "absent or disabled: spec.instances holds.")
    disaggregation: Disaggregation | None = Field(
        None, description="Prefill/decode disaggregation: separate prefill and decode "
        "instances with the KV moved between them. While set, the instance count is "
        "prefill.instances + decode.instances and spec.instances is ignored; spec.pools "
        "splits the prefill instances.")
    kv_tiers: KVTiers | None = Field(
        None, description="Host-memory (and optionally disk) tiers under each agent's "
        "prefix cache; absent: the cache is the GPU's KV pool alone.")
    tenants: TenantsRef | None = Field(
        None, description="Tenants and API keys (docs/tenancy.md); absent: the API is open.")

    @property
    def initial_short_instances(self) -> int:
        return self.pools.short if self.pools else 0

    @property
    def disaggregated(self) -> bool:
        return self.disaggregation is not None

    @property
    def autoscaled(self) -> bool:
        return self.autoscaling is not None and self.autoscaling.enabled
