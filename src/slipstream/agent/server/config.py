"""Settings of the HTTP layer, separate from the engine's: how to listen, how to label metrics,
what to assume when a request leaves a field out. Built once (by ``slipstream serve`` or a
test) and passed to ``build_app``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# The defaults and choices are the serve config's (agent/config); re-exported for the router.
from slipstream.agent.config.serving_sections import (
    DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_HOST, DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS,
    DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_TOKENS_CAP, DEFAULT_REQUEST_READ_TIMEOUT_S, LOG_LEVELS,
    TOOL_CALL_PARSERS)

__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "DEFAULT_HOST", "DEFAULT_LONG_PROMPT_THRESHOLD_TOKENS",
           "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_TOKENS_CAP", "DEFAULT_REQUEST_READ_TIMEOUT_S",
           "LOG_LEVELS", "TOOL_CALL_PARSERS", "ServerConfig", "bind_host"]


def bind_host(host: str | None) -> str:
    """The address ``slipstream router`` listens on: ``--host``, else the pod's own
    (``POD_IP``), else loopback. (``slipstream serve`` reads its environment with its config,
    server/serve_configs.py.)"""
    return host or os.environ.get("POD_IP") or DEFAULT_HOST


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
