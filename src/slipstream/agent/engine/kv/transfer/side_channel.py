"""The control channel between a prefill instance that holds KV blocks and the decode
instances that fetch them: ZeroMQ request/reply with msgspec-encoded messages.

    decode -> ["release", transfer_id]           <- ["ok"] | ["unknown"]
    decode -> ["read", transfer_id, [block ids]] <- ["ok", frames...] | ["error", why]
    decode -> ["progress", transfer_id, known, wait_s]
                                 <- ["ok", [block ids], done, first_token_id] | ["error", why]

``release`` acknowledges a transfer, so the holder frees the blocks. ``progress`` serves a
streaming handle (the prefill is still running): it answers with the blocks completed so
far once there are more than ``known`` of them, or the prefill is done, or ``wait_s`` has
passed (a long poll: the decode side asks again). ``read`` carries the
data itself for the ZeroMQ transport (``zmq_transport.py``): one frame per run of
consecutive blocks per KV region. The holder answers ``read`` only for blocks it holds under
that transfer id, so a peer can never read other requests' KV.

The server runs on its own thread; it never touches the block manager. It reports releases
through ``on_release`` (the engine frees blocks on its own thread) and looks blocks up
through ``lookup``, both thread-safe on the engine's side (``roles.exports.KVExports``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from slipstream.agent.engine.kv.transfer.mooncake import merge_runs
from slipstream.agent.engine.kv.transfer.transport import KVTransferError

log = logging.getLogger(__name__)

_POLL_MS = 100
_WAITING_POLL_MS = 2  # how often parked ``progress`` requests are looked at
_MAX_WAIT_S = 5.0

# (block ids completed so far, done, first token id or -1) of a held transfer, or None.
Progress = tuple[tuple[int, ...], bool, int]


@dataclass
class _Parked:
    identity: bytes
    transfer_id: str
    known: int
    deadline_s: float


class SideChannelServer:
    def __init__(self, host: str, port: int, lookup: Callable[[str], tuple[int, ...] | None],
                 on_release: Callable[[str], bool],
                 regions: list[torch.Tensor] | None = None,
                 progress: Callable[[str], Progress | None] | None = None) -> None:
        self._lookup = lookup
        self._on_release = on_release
        self._progress = progress
        self._parked: list[_Parked] = []  # progress requests waiting for new blocks
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
            if poller.poll(_WAITING_POLL_MS if self._parked else _POLL_MS):
                frames = self._socket.recv_multipart()
                identity, body = frames[0], frames[-1]
                try:
                    reply = self._handle(identity, msgspec.msgpack.decode(body))
                except Exception as error:  # noqa: BLE001 - a bad message must not stop it
                    log.warning("KV side channel: bad request: %s", error)
                    reply = [msgspec.msgpack.encode(["error", f"bad request: {error}"])]
                if reply is not None:
                    self._send(identity, reply)
            if self._parked:
                self._answer_parked()

    def _send(self, identity: bytes, reply: list) -> None:
        self._socket.send_multipart([identity, b"", *reply], copy=False)

    def _answer_parked(self) -> None:
        now = time.monotonic()
        still: list[_Parked] = []
        for parked in self._parked:
            reply = self._progress_reply(parked.transfer_id, parked.known,
                                         give_up=now >= parked.deadline_s)
            if reply is None:
                still.append(parked)
            else:
                self._send(parked.identity, reply)
        self._parked = still

    def _progress_reply(self, transfer_id: str, known: int, give_up: bool) -> list | None:
        state = self._progress(transfer_id) if self._progress is not None else None
        if state is None:
            return [msgspec.msgpack.encode(["error", f"no KV held under {transfer_id!r} (it "
                                                     "was released, timed out, or its prefill "
                                                     "ended without a KV hand-off)"])]
        block_ids, done, first_token_id = state
        if len(block_ids) <= known and not done and not give_up:
            return None
        return [msgspec.msgpack.encode(["ok", list(block_ids), done, first_token_id])]

    def _handle(self, identity: bytes, message: list) -> list | None:
        kind = message[0]
        if kind == "progress":
            transfer_id, known = str(message[1]), int(message[2])
            wait_s = min(max(float(message[3]), 0.0), _MAX_WAIT_S)
            reply = self._progress_reply(transfer_id, known, give_up=wait_s == 0)
            if reply is None:  # parked until there is news (or wait_s is up)
                self._parked.append(_Parked(identity, transfer_id, known,
                                            time.monotonic() + wait_s))
            return reply
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
        self._lock = threading.Lock()
        self._busy = False  # a thread is inside an exchange
        self._closed = False

    def request(self, address: str, message: list) -> list[bytes]:
        """Send ``message`` and return the reply frames after the status frame; raise
        KVTransferError if the peer answers with an error or not within the timeout."""
        return self._exchange(address, message)[1]

    def _exchange(self, address: str, message: list) -> tuple[list, list[bytes]]:
        with self._lock:
            if self._closed:
                raise KVTransferError("this instance is shutting down")
            self._busy = True
        try:
            frames = self._send_and_receive(address, message)
        finally:
            with self._lock:
                self._busy = False
                if self._closed:  # close() came while this thread used the sockets
                    self._close_sockets()
        status = msgspec.msgpack.decode(frames[0])
        if status[0] == "error":
            raise KVTransferError(f"the prefill instance at {address} refused: {status[1]}")
        if status[0] not in ("ok", "unknown"):
            raise KVTransferError(f"unexpected answer from {address}: {status!r}")
        return status, frames[1:]

    def _send_and_receive(self, address: str, message: list) -> list[bytes]:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.REQ)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            socket.connect(address)
            self._sockets[address] = socket
        deadline_s = time.monotonic() + self.timeout_s
        try:
            socket.send(msgspec.msgpack.encode(message))
            # Wait in slices, so that close() never has to wait for a silent peer.
            while not socket.poll(_POLL_MS, zmq.POLLIN):
                if self._closed:
                    self._drop(address)
                    raise KVTransferError("this instance is shutting down")
                if time.monotonic() >= deadline_s:
                    raise zmq.Again()
            return socket.recv_multipart(copy=True)
        except zmq.Again:
            self._drop(address)  # a REQ socket that missed its reply cannot be reused
            raise KVTransferError(f"the prefill instance at {address} did not answer within "
                                  f"{self.timeout_s:g} s") from None

    def progress(self, address: str, transfer_id: str, known: int,
                 wait_s: float) -> Progress:
        """The blocks of a streaming transfer completed so far, whether the prefill is done,
        and its first token; answered once there are more than ``known`` blocks, or it is
        done, or ``wait_s`` has passed."""
        if wait_s >= self.timeout_s:
            raise ValueError("wait_s must be shorter than the side channel's timeout")
        status, _ = self._exchange(address, ["progress", transfer_id, known, wait_s])
        try:
            block_ids = tuple(int(b) for b in status[1])
            return block_ids, bool(status[2]), int(status[3])
        except (IndexError, TypeError, ValueError):
            raise KVTransferError(f"unexpected progress answer from {address}: "
                                  f"{status!r}") from None

    def _drop(self, address: str) -> None:
        socket = self._sockets.pop(address, None)
        if socket is not None:
            socket.close(0)

    def close(self) -> None:
        """Stop: an exchange in progress ends within ``_POLL_MS`` with KVTransferError, and
        the sockets are closed by whichever thread leaves them last (zmq sockets must not be
        closed under a thread that is using them)."""
        with self._lock:
            self._closed = True
            if not self._busy:
                self._close_sockets()

    def _close_sockets(self) -> None:
        for address in list(self._sockets):
            self._drop(address)
