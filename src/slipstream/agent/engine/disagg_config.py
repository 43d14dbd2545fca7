"""How an agent takes part in prefill/decode disaggregation (``--role`` and the KV
transfer knobs). Kept free of torch and zmq: the server's CLI and the engine config read it;
the roles (``roles/``) act on it.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("mixed", "prefill", "decode")
TRANSPORTS = ("mooncake", "zmq")


@dataclass(frozen=True)
class DisaggConfig:
    role: str = "mixed"
    transport: str = "mooncake"  # one of TRANSPORTS
    host: str = "127.0.0.1"  # address peers reach this instance's transport and side channel at
    side_channel_port: int = 0  # 0: any free port
    # Prefill side: blocks held for a decode instance that never acknowledges are freed
    # after this long.
    hold_timeout_s: float = 120.0
    # Decode side: a prefill instance that does not answer within this long fails the request.
    transfer_timeout_s: float = 30.0
    # Blocks per read: 1 moves the KV strictly block by block; more amortises per-read cost.
    blocks_per_read: int = 8

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"KV transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.hold_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("KV transfer timeouts must be positive")
        if self.blocks_per_read < 1:
            raise ValueError("blocks_per_read must be at least 1")

    @property
    def enabled(self) -> bool:
        return self.role != "mixed"
