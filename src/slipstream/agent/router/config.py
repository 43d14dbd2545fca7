"""Settings of the pool router, built once by ``slipstream router`` (or a test) and passed to
``build_router_app``. Discovery is either static (``--backend URL=pool``) or Kubernetes pods.

The label keys match what the operator writes on agent pods (``operator/naming.py``): every
rank-0 pod carries ``slipstream.dev/role=controller``, its instance name and its pool, and its
container port named ``http`` serves the OpenAI API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from slipstream.agent.server.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_READ_TIMEOUT_S

SHORT_POOL = "short"
LONG_POOL = "long"
UNIFIED_POOL = "unified"  # an instance outside the short/long split serves both classes
# Decode instances of a disaggregated deployment (agents run with --role decode): they
# continue requests whose prompt a prefill instance (any other pool) computed. While any is
# known, the router chains prefill and decode (router/disagg.py).
DECODE_POOL = "decode"
POOLS = (SHORT_POOL, LONG_POOL, UNIFIED_POOL, DECODE_POOL)
REQUEST_CLASSES = (SHORT_POOL, LONG_POOL)
# What the dispatcher places: a request's prefill (by class), or its decode leg.
DISPATCH_CLASSES = (*REQUEST_CLASSES, DECODE_POOL)

POOL_LABEL = "slipstream.dev/pool"
INSTANCE_LABEL = "slipstream.dev/instance"
ROLE_LABEL = "slipstream.dev/role"
REPLICA_LABEL = "slipstream.dev/replica"
CONTROLLER_ROLE = "controller"
HTTP_PORT_NAME = "http"
DEFAULT_AGENT_PORT = 8000
# Matches the CRD's default pools.longPrefillThresholdTokens.
DEFAULT_LONG_PREFILL_THRESHOLD_TOKENS = 8192


@dataclass(frozen=True)
class StaticBackend:
    url: str  # http://host:port, no trailing /v1
    pool: str

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {self.url!r}")
        if self.pool not in POOLS:
            raise ValueError(f"backend pool must be one of {POOLS}, got {self.pool!r}")


@dataclass(frozen=True)
class KubernetesDiscovery:
    """Watch agent pods: every pod matching ``label_selector`` with a pod IP is a backend."""

    namespace: str
    label_selector: str = f"{ROLE_LABEL}={CONTROLLER_ROLE}"
    port_name: str = HTTP_PORT_NAME
    default_port: int = DEFAULT_AGENT_PORT  # when the container declares no port of that name
    kubeconfig: str | None = None  # None: in-cluster config, else $KUBECONFIG / ~/.kube/config


INSTANCE_QUEUE_ORDERS = ("shorter-first", "fifo")


@dataclass(frozen=True)
class FairnessConfig:
    """The fair queue's demand model: Justitia's cost needs each request's output length."""

    prior_output_tokens: int = 256  # predicted output of an application's first request

    def __post_init__(self) -> None:
        if self.prior_output_tokens < 1:
            raise ValueError("prior_output_tokens must be >= 1")


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    long_prefill_threshold_tokens: int = DEFAULT_LONG_PREFILL_THRESHOLD_TOKENS
    # An instance is saturated at this many router requests in flight, or at this predicted
    # backlog; when every candidate is saturated, requests wait in the fair queue.
    max_in_flight_per_instance: int = 64
    max_backlog_tokens_per_instance: int | None = None
    # A running decode weighs this many prefill tokens in the predicted backlog.
    decode_weight_tokens: int = 32
    stats_interval_s: float = 1.0
    max_attempts: int = 3  # instances tried per request before the first token
    connect_timeout_s: float = 5.0
    queue_timeout_s: float = 120.0  # longest wait in the fair queue before a 503
    unhealthy_cooldown_s: float = 5.0  # a failed instance gets no traffic for this long
    static_backends: tuple[StaticBackend, ...] = ()
    kubernetes: KubernetesDiscovery | None = None
    fairness: FairnessConfig = field(default_factory=FairnessConfig)
    log_level: str = "info"
    # Prefix-aware routing (prefix_affinity.py): an instance's score is its predicted backlog
    # minus the prefill its cache would save. 0 turns it off (least backlog only).
    prefix_block_tokens: int = 64
    prefix_affinity_weight: float = 2.0  # backlog tokens one cached prompt token is worth
    # A prompt token held in an instance's host or disk KV tier, against one on its GPU.
    lower_tier_hit_weight: float = 0.9
    # How the instances order their queued prefills, which decides how much of an instance's
    # backlog a new request waits behind (instances.py, predicted_backlog_tokens):
    # "shorter-first" (Slipstream's LARS short lane, SRPT) counts each queued prefill only up
    # to the new request's own uncached prompt; "fifo" (FCFS instances) counts all of it.
    instance_queue_order: str = "shorter-first"
    # Limits on one request, as on the agent (server/limits.py): 413 and 408.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    # The tenants file (server/tenancy/): keys, fair-share weights, SLO classes, limits;
    # None: open, as the agents are without one.
    tenants_path: Path | None = None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.request_read_timeout_s > 0:
            raise ValueError("request_read_timeout_s must be positive")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.long_prefill_threshold_tokens < 1:
            raise ValueError("long_prefill_threshold_tokens must be positive")
        if self.max_in_flight_per_instance < 1:
            raise ValueError("max_in_flight_per_instance must be >= 1")
        if self.max_backlog_tokens_per_instance is not None \
                and self.max_backlog_tokens_per_instance < 1:
            raise ValueError("max_backlog_tokens_per_instance must be >= 1")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        for name in ("stats_interval_s", "connect_timeout_s", "queue_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not 0.0 <= self.lower_tier_hit_weight <= 1.0:
            raise ValueError("lower_tier_hit_weight must be within [0, 1]")
        if self.prefix_affinity_weight < 0:
            raise ValueError("prefix_affinity_weight must be >= 0")
        if self.instance_queue_order not in INSTANCE_QUEUE_ORDERS:
            raise ValueError(f"instance_queue_order must be one of {INSTANCE_QUEUE_ORDERS}, "
                             f"got {self.instance_queue_order!r}")
        if self.prefix_block_tokens < 0:
            raise ValueError("prefix_block_tokens must be >= 0 (0 turns prefix routing off)")
        if self.unhealthy_cooldown_s < 0 or self.decode_weight_tokens < 0:
            raise ValueError("unhealthy_cooldown_s and decode_weight_tokens must be >= 0")
        if bool(self.static_backends) == (self.kubernetes is not None):
            raise ValueError("give either static backends or Kubernetes discovery, not both "
                             "and not neither")
