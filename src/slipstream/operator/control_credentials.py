"""The operator's credentials for the agents' gRPC control port (contracts/control_auth.py).

    chart Secret <release>-control-master (mounted) --ControlCredentials.from_file-->
        token(namespace, replica) = HMAC-SHA256(master key, "namespace/replica")
    reconcile: Secret <replica>-control {token} (create only) --> mounted by the replica's
        rank-0 agent pods (slipstream serve --control-token-file)
    rebalancer / autoscaler: Stats and SetPool calls carry "authorization: Bearer <token>"

Deriving the token means the operator never reads a Secret back: its RBAC holds ``create``
on Secrets and nothing else there, so it cannot read any other Secret in the namespaces it
manages. Without a master key (``--control-master-key-file`` not given) the operator makes no
Secrets and the agents' control ports stay open, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slipstream.contracts.control_auth import MIN_TOKEN_CHARS, derive_control_token


@dataclass(frozen=True)
class ControlCredentials:
    master_key: bytes | None = None

    @classmethod
    def from_file(cls, path: Path | None) -> ControlCredentials:
        if path is None:
            return cls()
        key = path.read_bytes().strip()
        if len(key) < MIN_TOKEN_CHARS:
            raise ValueError(f"the control master key in {path} is shorter than "
                             f"{MIN_TOKEN_CHARS} characters")
        return cls(key)

    @property
    def enabled(self) -> bool:
        return self.master_key is not None

    def token(self, namespace: str, replica: str) -> str | None:
        if self.master_key is None:
            return None
        return derive_control_token(self.master_key, namespace, replica)
