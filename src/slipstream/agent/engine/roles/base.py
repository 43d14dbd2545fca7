"""The hook an engine calls its role through (``Role``), the mixed role's, and ``make_role``.

``LLMEngine`` knows one object, its role, and calls it at fixed points of a request's life:
when it is added (``admit``), before each step (``arrivals``), after each step's update
(``published``), when its first token is processed (``hand_off``), when it is aborted
(``cancel``), and for the stats and shutdown. The mixed role (plain serving) does nothing at
any of them; the prefill and decode roles (disagg.py) move KV between instances there.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from slipstream.contracts.request import KVTransfer
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import FinishReason, Request

if TYPE_CHECKING:
    from slipstream.agent.engine.disagg_config import DisaggConfig


class Role(Protocol):
    def admit(self, request: Request, kv_transfer: KVTransfer | None, vocab_size: int,
              known: Container[str]) -> bool:
        """A request is being added; ValueError if this role cannot serve its
        ``kv_transfer``. True if the role keeps it until its KV arrives (``arrivals``);
        False if the engine queues it in the scheduler now."""
        ...

    def arrivals(self, now: float, vocab_size: int,
                 waiting: Container[str]) -> Iterator[tuple[Request, bool]]:
        """Requests kept by ``admit`` whose KV arrived (True; they hold their blocks and
        first token) or could not be fetched (False; finished with an error)."""
        ...

    def published(self, batch: Batch, failures: Container[str],
                  requests: Mapping[str, Request]) -> None:
        """After the scheduler's update of each step."""
        ...

    def hand_off(self, request: Request, now: float, reason: FinishReason | None
                 ) -> tuple[dict[str, Any] | None, FinishReason | None]:
        """A token of ``request`` was processed (``reason``: why it ends, if it does). Returns
        the KV handle for its final output, if any, and why it ends here."""
        ...

    def cancel(self, request_id: str) -> Request | None:
        """The request is aborted: the request if the role kept it (the engine finishes it
        there), else None (it is in the scheduler)."""
        ...

    def handle_output(self, request: Request) -> RequestOutput | None:
        """The output to send right after the request was added, if any."""
        ...

    def drop_kv(self, transfer_id: str) -> None:
        """Free a hold handed off already (a stop string found after the engine finished the
        request, by the API process of a two-process server)."""
        ...

    @property
    def num_pending(self) -> int:
        """Requests kept by the role: the engine has work while any remain."""
        ...

    def transfer_stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def require(flag: str, role: str) -> ValueError:
    """The error for a request that asks for ``flag`` (``kv_transfer_params``) from an
    instance not in ``role``."""
    return ValueError(f"kv_transfer_params.{flag} needs a {role} instance "
                      f"(slipstream serve --role {role})")


def check_kv_transfer(kv_transfer: KVTransfer | None, *, prefill: bool, decode: bool) -> None:
    """ValueError for a ``kv_transfer`` this instance's role cannot serve."""
    if kv_transfer is None:
        return
    if kv_transfer.handle is not None and not decode:
        raise require("do_remote_prefill", "decode")
    if kv_transfer.handle is None and kv_transfer.remote_decode and not prefill:
        raise require("do_remote_decode", "prefill")


class MixedRole:
    """Prefill and decode on this instance: no hook does anything."""

    def admit(self, request: Request, kv_transfer: KVTransfer | None, vocab_size: int,
              known: Container[str]) -> bool:
        check_kv_transfer(kv_transfer, prefill=False, decode=False)
        return False

    def arrivals(self, now: float, vocab_size: int,
                 waiting: Container[str]) -> Iterator[tuple[Request, bool]]:
        return iter(())

    def published(self, batch: Batch, failures: Container[str],
                  requests: Mapping[str, Request]) -> None:
        pass

    def hand_off(self, request: Request, now: float, reason: FinishReason | None
                 ) -> tuple[dict[str, Any] | None, FinishReason | None]:
        return None, reason

    def cancel(self, request_id: str) -> Request | None:
        return None

    def handle_output(self, request: Request) -> RequestOutput | None:
        return None

    def drop_kv(self, transfer_id: str) -> None:
        pass

    num_pending = 0

    def transfer_stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


def make_role(config: DisaggConfig, runner: object, block_manager: BlockManager,
              clock: Callable[[], float]) -> Role:
    """The role ``--role`` names. The prefill and decode roles need the in-process model
    runner (they read and write its KV cache directly)."""
    if not config.enabled:
        return MixedRole()
    from slipstream.agent.engine.roles.disagg import DisaggRole  # zmq, transfer engines
    from slipstream.agent.engine.roles.transfers import Disaggregation

    kv_caches = getattr(runner, "kv_caches", None)
    if kv_caches is None:
        raise ValueError(f"--role {config.role} needs the in-process model runner")
    return DisaggRole(Disaggregation(config, kv_caches, block_manager, clock))
