"""The control channel between a prefill instance that holds KV blocks and the decode
instances that fetch them: ZeroMQ request/reply with msgspec-encoded messages.

    decode -> ["release", transfer_id]           <- ["ok"] | ["unknown"]
    decode -> ["read", transfer_id, [block ids]] <- ["ok", frames...] | ["error", why]

``release`` acknowledges a transfer, so the holder frees the blocks. ``read`` carries the
data itself for the ZeroMQ transport (``zmq_transport.py``): one frame per run of
consecutive blocks per KV region. The holder answers ``read`` only for blocks it holds under
that transfer id, so a peer can never read other requests' KV.

The server runs on its own thread; it never touches the block manager. It reports releases
through ``on_release`` (the engine frees blocks on its own thread) and looks blocks up
through ``lookup``, both thread-safe on the engine's side (``disagg.KVExports``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import msgspec
import torch
import zmq

from slipstream.agent.engine.kv_transfer.mooncake import merge_runs
from slipstream.agent.engine.kv_transfer.transport import KVTransferError

log = logging.getLogger(__name__)

_POLL_MS = 100


class SideChannelServer:
    def __init__(self, host: str, port: int, lookup: Callable[[str], tuple[int, ...] | None],
                 on_release: Callable[[str], bool],
                 regions: list[torch.Tensor] | None = None) -> None:
        self._lookup = lookup
        self._on_release = on_release
        self._regions = regions  # set when this channel also carries the data (zmq transport)
        self._context: zmq.Context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="slipstream-kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(_POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            identity, body = frames[0], frames[-1]
            try:
                reply = self._handle(msgspec.msgpack.decode(body))
            except Exception as error:  # noqa: BLE001 - a bad message must not stop the channel
                log.warning("KV side channel: bad request: %s", error)
                reply = [msgspec.msgpack.encode(["error", f"bad request: {error}"])]
            self._socket.send_multipart([identity, b"", *reply], copy=False)

    def _handle(self, message: list) -> list:
        kind = message[0]
        if kind == "release":
            known = self._on_release(str(message[1]))
            return [msgspec.msgpack.encode(["ok" if known else "unknown"])]
        if kind == "read":
            return self._read(str(message[1]), [int(b) for b in message[2]])
        return [msgspec.msgpack.encode(["error", f"unknown request {kind!r}"])]

    def _read(self, transfer_id: str, block_ids: list[int]) -> list:
        if self._regions is None:
            return [msgspec.msgpack.encode(["error", "this instance sends KV over another "
                                                     "transport; reads are not served here"])]
        held = self._lookup(transfer_id)
        if held is None:
            return [msgspec.msgpack.encode(["error", f"no KV held under {transfer_id!r} (it "
                                                     "was released or timed out)"])]
        if not set(block_ids) <= set(held):
            return [msgspec.msgpack.encode(["error", "blocks not held under this transfer"])]
        frames: list = [msgspec.msgpack.encode(["ok"])]
        for start, _, count in merge_runs(block_ids, block_ids):
            for region in self._regions:
                data = region[start:start + count]
                if data.device.type != "cpu":
                    data = data.cpu()
                frames.append(data.contiguous().view(torch.uint8).numpy())
        return frames


class SideChannelClient:
    """Request/reply to holders' side channels; one socket per peer, used by one thread."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._context: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}

    def request(self, address: str, message: list) -> list[bytes]:
        """Send ``message`` and return the reply frames after the status frame; raise
        KVTransferError if the peer answers with an error or not within the timeout."""
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
            socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            socket.connect(address)
            self._sockets[address] = socket
        try:
            socket.send(msgspec.msgpack.encode(message))
            frames = socket.recv_multipart(copy=True)
        except zmq.Again:
            self._drop(address)  # a REQ socket that missed its reply cannot be reused
            raise KVTransferError(f"the prefill instance at {address} did not answer within "
                                  f"{self.timeout_s:g} s") from None
        status = msgspec.msgpack.decode(frames[0])
        if status[0] == "error":
            raise KVTransferError(f"the prefill instance at {address} refused: {status[1]}")
        if status[0] not in ("ok", "unknown"):
            raise KVTransferError(f"unexpected answer from {address}: {status!r}")
        return frames[1:]

    def _drop(self, address: str) -> None:
        socket = self._sockets.pop(address, None)
        if socket is not None:
            socket.close(0)

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)
