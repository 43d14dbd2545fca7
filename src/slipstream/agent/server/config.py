"""Settings of the HTTP layer, separate from the engine's: how to listen, how to label metrics,
what to assume when a request leaves a field out. Built once (by ``slipstream serve`` or a
test) and passed to ``build_app``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

# Matches the CRD's default pools.longPrefillThresholdTokens, so dashboards and the router
# agree on what "long" means.
DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS = 8192
# A request without max_tokens may use the rest of the context (as vLLM does), but no more
# than this: an unbounded default lets one careless client hold a long-context model's KV.
DEFAULT_MAX_TOKENS_CAP = 16_384
# Limits on one request's body (server/limits.py, shared with the router).
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
# On SIGTERM, requests in flight get this long to finish (server/drain.py). Long enough for
# most streams; the operator gives the pod this plus a margin before SIGKILL.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
# `slipstream serve` and `slipstream router` alike: where to listen without --host or
# $POD_IP, and the --log-level choices.
DEFAULT_HOST = "127.0.0.1"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def bind_host(args: argparse.Namespace) -> str:
    """The address to listen on: ``--host``, else the pod's own (``POD_IP``), else loopback."""
    return args.host or os.environ.get("POD_IP") or DEFAULT_HOST


def add_request_limit_arguments(http: argparse._ArgumentGroup) -> None:
    """The flags of the per-request limits (limits.py) and --log-level, which ``slipstream
    serve`` and ``slipstream router`` both take."""
    http.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                      metavar="BYTES", help="larger request bodies get 413, unread")
    http.add_argument("--request-read-timeout-s", type=float,
                      default=DEFAULT_REQUEST_READ_TIMEOUT_S, metavar="S",
                      help="a client must send the request line and headers within this "
                           "long, and then the body within this long, else 408")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info")


def add_tenants_argument(group: argparse._ArgumentGroup) -> None:
    """``--tenants FILE``, which ``slipstream serve`` and ``slipstream router`` both take."""
    group.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                       help="tenants YAML (docs/tenancy.md): API keys (as SHA-256 digests), "
                            "fair-share weights, SLO classes and rate limits; every /v1 request "
                            "then needs 'Authorization: Bearer KEY'. Without it the API is "
                            "open to any caller, as the start-up line says")


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    port: int = 8000
    pool: str = "unified"  # metrics label: which prefill pool this instance serves
    long_prompt_threshold_tokens: int = DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS
    default_max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP
    # The ServingReplica's SLO: applied (for metrics) to requests that bring none of their own.
    slo_ttft_s: float | None = None
    slo_tpot_ms: float | None = None
    slo_attainment_target: float = 0.99
    log_level: str = "info"
    control_port: int = 50051  # gRPC control API; 0 turns it off
    # On SIGTERM, how long requests in flight may run on before they are ended (drain.py).
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Limits on one request (limits.py): body size (413) and time to send it (408).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    # The model's tool-call syntax (server/tool_parsers.py): auto (from the chat template),
    # hermes, llama3_json or mistral.
    tool_call_parser: str = "auto"
    # The tenants file (tenancy/config.py); None: open, no API keys.
    tenants_path: Path | None = None
    # The control port's bearer token (control_auth.py); None: the port is open.
    control_token_file: Path | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.long_prompt_threshold_tokens < 1:
            raise ValueError("long_prompt_threshold_tokens must be positive")
        if self.default_max_tokens_cap < 1:
            raise ValueError("default_max_tokens_cap must be positive")
        for name in ("slo_ttft_s", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 < self.slo_attainment_target < 1:
            raise ValueError("slo_attainment_target must be in (0, 1), got "
                             f"{self.slo_attainment_target}")
        if not self.pool:
            raise ValueError("pool must be a non-empty label")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"drain_timeout_s must be in [0, 3600], got {self.drain_timeout_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if not self.request_read_timeout_s > 0:
            raise ValueError("request_read_timeout_s must be positive, got "
                             f"{self.request_read_timeout_s}")
        if not 0 <= self.control_port <= 65535:
            raise ValueError(f"control_port must be in [0, 65535], got {self.control_port}")
