"""The transfer-engine interface the engine uses, and the handle that names a held request.

A transport moves whole blocks between the registered KV tensors of two instances. The
prefill side only registers its tensors and publishes where they are (``descriptor``); the
decode side reads the blocks it needs (``read_blocks``), block by block, into blocks it
allocated itself. Both sides must have the same ``KVLayout`` (model, dtype, block size);
``read_blocks`` refuses a handle whose layout differs.
"""

from __future__ import annotations

import abc
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.agent.engine.kv.transfer.layout import KVLayout

TRANSPORT_NAMES = ("mooncake", "zmq")


class KVTransferError(RuntimeError):
    """A transfer could not be completed (peer gone, layout mismatch, engine error)."""


def prompt_digest(token_ids: list[int]) -> str:
    """A short fingerprint of a prompt, so the decode side can tell that the prompt it
    tokenized is the one whose KV it is about to receive."""
    data = b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids)
    return hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True)
class KVHandle:
    """Everything a decode instance needs to fetch a request's KV from a prefill instance.

    It travels as JSON (``kv_transfer_params`` in the OpenAI request and response bodies).
    A *streaming* handle is given out when the prefill starts, before its blocks exist: it
    has no ``block_ids`` and no first token (-1). A decode instance holding one asks the
    holder's side channel for the blocks completed so far (``progress``), reads them while
    later prefill chunks compute, and learns the last blocks and the first token at the end.
    """

    transfer_id: str
    transport: str  # one of TRANSPORT_NAMES
    side_channel: str  # tcp://host:port of the holder's side channel (acks; zmq data)
    endpoint: str  # the transport's own address on the holder ("" for zmq)
    region_addrs: tuple[int, ...]  # base address of each KV region on the holder (mooncake)
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens whose KV the blocks hold (the prompt)
    prompt_digest: str
    first_token_id: int  # -1 in a streaming handle
    streaming: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id, "transport": self.transport,
            "side_channel": self.side_channel, "endpoint": self.endpoint,
            "region_addrs": list(self.region_addrs), "layout": self.layout.to_dict(),
            "block_ids": list(self.block_ids), "num_tokens": self.num_tokens,
            "prompt_digest": self.prompt_digest, "first_token_id": self.first_token_id,
            "streaming": self.streaming,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KVHandle:
        """Parse a handle; ValueError (with the field named) if it is malformed."""
        try:
            handle = cls(
                transfer_id=str(raw["transfer_id"]), transport=str(raw["transport"]),
                side_channel=str(raw["side_channel"]), endpoint=str(raw.get("endpoint", "")),
                region_addrs=tuple(int(a) for a in raw.get("region_addrs", ())),
                layout=KVLayout.from_dict(raw["layout"]),
                block_ids=tuple(int(b) for b in raw["block_ids"]),
                num_tokens=int(raw["num_tokens"]), prompt_digest=str(raw["prompt_digest"]),
                first_token_id=int(raw["first_token_id"]),
                streaming=bool(raw.get("streaming", False)))
        except KeyError as error:
            raise ValueError(f"kv_transfer_params is missing {error.args[0]!r}") from None
        except (TypeError, ValueError) as error:
            raise ValueError(f"kv_transfer_params is malformed: {error}") from None
        if handle.transport not in TRANSPORT_NAMES:
            raise ValueError(f"kv_transfer_params.transport must be one of {TRANSPORT_NAMES}, "
                             f"got {handle.transport!r}")
        expected = -(-handle.num_tokens // handle.layout.block_size)
        if handle.num_tokens < 1:
            raise ValueError("kv_transfer_params.num_tokens must be at least 1")
        if handle.streaming:
            if handle.block_ids:
                raise ValueError("a streaming kv_transfer_params carries no block_ids: the "
                                 "decode instance asks the prefill instance for them")
        elif handle.first_token_id < 0:
            raise ValueError("kv_transfer_params.first_token_id must be >= 0")
        elif len(handle.block_ids) != expected:
            raise ValueError(f"kv_transfer_params.block_ids has {len(handle.block_ids)} blocks; "
                             f"{handle.num_tokens} tokens need {expected}")
        return handle


class KVTransport(abc.ABC):
    """Moves KV blocks between the registered KV tensors of two instances."""

    name: str

    def __init__(self, layout: KVLayout, regions: list[torch.Tensor]) -> None:
        if len(regions) != layout.num_regions:
            raise ValueError(f"expected {layout.num_regions} KV regions, got {len(regions)}")
        self.layout = layout
        self.regions = regions

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where peers reach this transport ("" when the side channel carries the data)."""

    def region_addrs(self) -> tuple[int, ...]:
        return tuple(region.data_ptr() for region in self.regions)

    def check_compatible(self, handle: KVHandle) -> None:
        if handle.transport != self.name:
            raise KVTransferError(f"the prefill instance uses the {handle.transport} transport "
                                  f"and this instance {self.name}; configure both alike")
        if handle.layout != self.layout:
            raise KVTransferError(f"KV layout differs between the prefill instance "
                                  f"({handle.layout}) and this instance ({self.layout}): "
                                  "both must serve the same model with the same dtype")

    @abc.abstractmethod
    def read_blocks(self, handle: KVHandle, remote_block_ids: list[int],
                    local_block_ids: list[int]) -> None:
        """Copy the holder's blocks ``remote_block_ids`` into this instance's
        ``local_block_ids`` (same length), every region; raise KVTransferError on failure."""

    def close(self) -> None:
        """Release what the transport holds (sockets, registrations)."""


def make_transport(name: str, layout: KVLayout, regions: list[torch.Tensor], host: str,
                   side_channel: Any = None) -> KVTransport:
    """The transport called ``name``; the real engine is imported only when asked for."""
    if name == "mooncake":
        from slipstream.agent.engine.kv.transfer.mooncake import MooncakeTransport

        return MooncakeTransport(layout, regions, host)
    if name == "zmq":
        from slipstream.agent.engine.kv.transfer.zmq_transport import ZmqTransport

        return ZmqTransport(layout, regions, side_channel)
    raise ValueError(f"unknown KV transport {name!r}; choose one of {TRANSPORT_NAMES}")
