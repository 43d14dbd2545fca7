"""The sections of the serve config the serving side reads: ``slo``, ``pools``, ``server``,
``disaggregation`` and ``kvTiers`` (the engine's are in engine_sections.py).

``server.host``, ``pools.pool`` and ``disaggregation.role`` also come from the pod's
environment (``POD_IP``, ``SLIPSTREAM_POOL``, ``SLIPSTREAM_ROLE``); server/serve_configs.py
reads it, below the file and the flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import field_validator, model_validator

from slipstream.agent.config.setting import Section, setting
from slipstream.agent.config.sizes import parse_size_bytes

DEFAULT_HOST = "127.0.0.1"
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ROLES = ("mixed", "prefill", "decode")
KV_TRANSPORTS = ("mooncake", "zmq")
# Matches the CRD's default pools.longPrefillThresholdTokens, so dashboards and the router
# agree on what "long" means.
DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS = 8192
# A request without max_tokens may use the rest of the context (as vLLM does), but no more
# than this: an unbounded default lets one careless client hold a long-context model's KV.
DEFAULT_MAX_TOKENS_CAP = 16_384
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
# On SIGTERM, requests in flight get this long to finish (server/drain.py). Long enough for
# most streams; the operator gives the pod this plus a margin before SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class SloSettings(Section):
    """The ServingReplica's service-level objectives, for requests that bring no slo of their
    own: counted in slipstream_slo_requests_total, drawn on the dashboards, read by the
    burn-rate alerts. The TPOT objective is also the packer's default time budget."""

    ttft_seconds: float | None = setting(
        None, "TTFT objective for requests that bring no slo of their own",
        flag="--slo-ttft-seconds", metavar="S", gt=0)
    tpot_milliseconds: float | None = setting(
        None, "TPOT objective for requests that bring no slo of their own",
        flag="--slo-tpot-ms", metavar="MS", gt=0)
    attainment_target: float = setting(
        0.99, "share of requests that should meet their SLO; the burn-rate alerts read it from "
        "slipstream_slo_attainment_target_ratio", flag="--slo-attainment-target",
        metavar="RATIO", gt=0, lt=1)


class PoolSettings(Section):
    """Short/long prefill pools (PLA-Serve): which one this instance serves, as a metrics
    label, and where long starts."""

    pool: str = setting(
        "unified", "pool label on latency metrics (short, long, unified); $SLIPSTREAM_POOL "
        "when not given", min_length=1)
    long_prefill_threshold_tokens: int = setting(
        DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS, "prompts this long or longer are labelled "
        "request_class=long", flag="--long-prompt-threshold-tokens", metavar="TOKENS", ge=1)


class ServerSettings(Section):
    """The HTTP and gRPC servers, request limits, tenants, and where the engine runs: in a
    process of its own (the default), so HTTP, tokenization and detokenization never
    stretch its steps, or on a thread of the server process (--single-process)."""

    host: str = setting(DEFAULT_HOST, "address to bind; $POD_IP when not given", min_length=1)
    port: int = setting(8000, "TCP port of the OpenAI API", ge=0, le=65535)
    control_port: int = setting(
        50051, "gRPC control API port (health, stats, pool role; the operator's rebalancer "
        "reads it); 0 turns it off", metavar="PORT", ge=0, le=65535)
    control_token_file: Path | None = setting(
        None, "every control call must carry 'authorization: Bearer <the token in FILE>' (the "
        "operator mounts one per ServingReplica; re-read when it changes); without it the "
        "control port is open", metavar="FILE")
    tenants: Path | None = setting(
        None, "tenants YAML (docs/tenancy.md): API keys (as SHA-256 digests), fair-share "
        "weights, SLO classes and rate limits; every /v1 request then needs 'Authorization: "
        "Bearer KEY'. Without it the API is open to any caller, as the start-up line says",
        metavar="FILE")
    default_max_tokens: int = setting(
        DEFAULT_MAX_TOKENS_CAP, "cap on max_tokens for requests that leave it out (they "
        "otherwise get the rest of the context)", metavar="TOKENS", ge=1)
    max_body_bytes: int = setting(
        DEFAULT_MAX_BODY_BYTES, "larger request bodies get 413, unread", metavar="BYTES",
        ge=1024)
    request_read_timeout_seconds: float = setting(
        DEFAULT_REQUEST_READ_TIMEOUT_S, "a client must send the request line and headers "
        "within this long, and then the body within this long, else 408",
        flag="--request-read-timeout-s", metavar="S", gt=0)
    drain_timeout_seconds: float = setting(
        DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM: stop taking requests (503, not ready), give "
        "those in flight this long to finish, end the rest with an error event and [DONE], "
        "then exit 0. The pod's terminationGracePeriodSeconds must be longer (the operator "
        "sets it)", flag="--drain-timeout-s", metavar="S", ge=0, le=3600)
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = setting(
        "auto", "the model's tool-call syntax, turned into OpenAI tool_calls: hermes (Qwen, "
        "Hermes, ChatML), llama3_json (Llama 3.1+), mistral; auto picks it from the chat "
        "template")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = setting(
        "info", "log level of the server and the engine")
    single_process: bool = setting(
        False, "run the engine (scheduler, KV blocks, model or workers) on a thread of the "
        "server process instead of a process of its own (docs/engine.md)",
        switches={"--single-process": True, "--no-engine-process": True,
                  "--engine-process": False})
    api_processes: int = setting(
        1, "HTTP processes sharing the one engine core, all on --port (SO_REUSEPORT): each "
        "tokenizes, detokenizes and streams the requests it accepted; /metrics merges their "
        "request metrics. Needs the engine in its own process and the mixed role "
        "(docs/engine.md)", metavar="N", ge=1)


class DisaggregationSettings(Section):
    """Prefill/decode disaggregation: a prefill instance computes prompts and their first
    token and keeps their KV for a decode instance, which fetches it and continues
    (docs/disaggregation.md). The router (slipstream router, given decode instances as
    --backend URL=decode or as pods in the decode pool) chains the two."""

    role: Literal["mixed", "prefill", "decode"] = setting(
        "mixed", "this instance's part (mixed: prefill and decode here, no KV transfer); "
        "$SLIPSTREAM_ROLE when not given")
    transport: Literal["mooncake", "zmq"] = setting(
        "mooncake", "how KV moves between instances: mooncake (Mooncake Transfer Engine over "
        "TCP, or RDMA on GPU hosts) or zmq (bytes over the ZeroMQ side channel; needs nothing "
        "else installed)", flag="--kv-transport")
    side_channel_port: int = setting(
        0, "prefill role: TCP port of the KV side channel (acknowledgements, and the data "
        "with --kv-transport zmq); 0 picks a free one", flag="--kv-side-channel-port",
        metavar="PORT", ge=0, le=65535)
    hold_timeout_seconds: float = setting(
        120.0, "prefill role: free KV that no decode instance fetched after this long",
        flag="--kv-hold-timeout-seconds", metavar="S", gt=0)
    blocks_per_read: int = setting(
        8, "decode role: KV blocks fetched per transfer-engine read",
        flag="--kv-blocks-per-read", metavar="BLOCKS", ge=1)


class KVTierSettings(Section):
    """Host memory and disk under the device's prefix cache (docs/kv-tiers.md): a prefix
    found there is loaded back instead of recomputed."""

    host_memory: str | None = setting(
        None, "host memory for KV blocks evicted from the device (pinned on CUDA), e.g. "
        "64GiB. Default: no host tier", flag="--kv-host-memory", metavar="SIZE")
    disk_path: Path | None = setting(
        None, "directory for a disk tier below the host tier (checksummed block files); needs "
        "--kv-disk-size and --kv-host-memory", flag="--kv-disk-path", metavar="DIR")
    disk_size: str | None = setting(
        None, "most the disk tier may hold, e.g. 500GiB", flag="--kv-disk-size",
        metavar="SIZE")

    @field_validator("host_memory", "disk_size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size_bytes(value)
        return value

    @model_validator(mode="after")
    def _disk_needs_host(self) -> KVTierSettings:
        if (self.disk_path is None) != (self.disk_size is None):
            raise ValueError("diskPath and diskSize (--kv-disk-path, --kv-disk-size) go "
                             "together")
        if self.disk_path is not None and self.host_memory is None:
            raise ValueError("a disk tier needs a host tier (hostMemory, --kv-host-memory): "
                             "disk blocks are staged through host memory")
        return self
