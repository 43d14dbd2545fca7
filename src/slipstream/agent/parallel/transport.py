"""ZeroMQ transport between the controller (scheduler + API) and the worker processes.

    controller ROUTER  <---- one DEALER per worker (identity = its rank)
      HELLO (worker joined) -> INIT (engine config) -> READY (KV blocks it can hold)
      BATCH seq, WireBatch    controller -> every worker, once per iteration (a diff: wire.py)
      MASKS seq, WireMasks, bitmask
                              controller -> the sampler rank, right after a BATCH that has
                              rows under a grammar (``WireBatch.masked``)
      RESULT seq, sampled     sampler rank -> controller, once per batch
      TRACE / TRACE_REPLY     compute spans, on request
      ERROR text              a worker failed; STOP: shut down

The per-iteration messages (the batch diff, sampled tokens) are msgpack via msgspec: on a
batch of 32 decodes it encodes and decodes about 6x faster than pickle (see ``bench``).
Rare control messages are pickled.

Liveness: both ends watch their socket's monitor for disconnects, and ZMTP heartbeats turn a
silent peer (a dead node, a cut network) into a disconnect within ``HEARTBEAT_TIMEOUT_MS``.
A killed process closes its TCP connection at once, so its loss is seen immediately.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.engine.sampling.sampler import GrammarMasks
from slipstream.agent.parallel.wire import WireBatch, WireMasks

HELLO, INIT, READY, BATCH, MASKS, RESULT, TRACE, TRACE_REPLY, ERROR, STOP = (
    b"H", b"I", b"R", b"B", b"M", b"S", b"T", b"t", b"E", b"Q")
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(WireBatch)
_masks_decoder = msgspec.msgpack.Decoder(WireMasks)
_sampled_decoder = msgspec.msgpack.Decoder(dict[str, SampledToken])


class PeerLost(RuntimeError):
    """A ZeroMQ peer disconnected (its process died, or heartbeats stopped)."""


def encode_batch(batch_seq: int, batch: WireBatch) -> list[bytes]:
    return [batch_seq.to_bytes(8, "little"), _encoder.encode(batch)]


def decode_batch(frames: list[bytes]) -> tuple[int, WireBatch]:
    return int.from_bytes(frames[0], "little"), _batch_decoder.decode(frames[1])


def encode_masks(batch_seq: int, masks: GrammarMasks) -> list[bytes]:
    """A step's grammar masks: the rows and dead rows in msgpack, the int32 bitmask
    [rows, words] as raw little-endian bytes (a copy: the engine reuses its buffer)."""
    allowed = masks.allowed
    if allowed.dtype != torch.int32 or allowed.dim() != 2 or allowed.shape[0] != len(masks.rows):
        raise TypeError(f"grammar masks cross to the workers as an int32 bitmask with one row "
                        f"per guided row, not {allowed.dtype} {tuple(allowed.shape)}")
    words = allowed.shape[1]
    bitmask = allowed.detach().cpu().contiguous().numpy().astype("<i4", copy=False).tobytes()
    header = WireMasks(tuple(masks.rows), words, tuple(masks.dead_rows))
    return [batch_seq.to_bytes(8, "little"), _encoder.encode(header), bitmask]


def decode_masks(frames: list[bytes]) -> tuple[int, GrammarMasks]:
    header = _masks_decoder.decode(frames[1])
    bits = np.frombuffer(frames[2], dtype="<i4").astype(np.int32)  # a writable native copy
    allowed = torch.from_numpy(bits.reshape(len(header.rows), header.words))
    return int.from_bytes(frames[0], "little"), GrammarMasks(
        rows=list(header.rows), allowed=allowed, dead_rows=list(header.dead_rows))


def encode_sampled(batch_seq: int, sampled: dict[str, SampledToken]) -> list[bytes]:
    return [batch_seq.to_bytes(8, "little"), _encoder.encode(sampled)]


def decode_sampled(frames: list[bytes]) -> tuple[int, dict[str, SampledToken]]:
    return int.from_bytes(frames[0], "little"), _sampled_decoder.decode(frames[1])


def encode_object(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode_object(raw: bytes) -> Any:
    return pickle.loads(raw)  # noqa: S301 - only between our own processes


def _configure(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class ControllerSocket:
    """The controller's end: one ROUTER that every worker connects to."""

    def __init__(self, bind_host: str = "127.0.0.1", port: int | None = None) -> None:
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        _configure(self.router)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        if port:
            self.router.bind(f"tcp://{bind_host}:{port}")
            self.port = port
        else:
            self.port = self.router.bind_to_random_port(f"tcp://{bind_host}")
        self.monitor = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.identities: list[bytes] = []

    def send(self, identity: bytes, kind: bytes, *frames: bytes) -> None:
        try:
            self.router.send_multipart([identity, kind, *frames], copy=False)
        except zmq.ZMQError as error:  # EHOSTUNREACH under ROUTER_MANDATORY
            raise PeerLost(f"cannot reach worker {identity.decode()}: {error}") from None

    def broadcast(self, kind: bytes, *frames: bytes) -> None:
        for identity in self.identities:
            self.send(identity, kind, *frames)

    def recv(self, timeout_s: float) -> tuple[bytes, bytes, list[bytes]] | None:
        """One message ``(identity, kind, frames)``, or None after ``timeout_s``."""
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.monitor in events:
            event = recv_monitor_message(self.monitor)
            raise PeerLost(f"a worker disconnected ({event.get('endpoint', b'').decode()})")
        if self.router not in events:
            return None
        identity, kind, *frames = self.router.recv_multipart()
        return identity, kind, frames

    def close(self) -> None:
        self.router.disable_monitor()
        self.monitor.close(0)
        self.router.close(0)
        self.context.term()


class WorkerSocket:
    """A worker's end: a DEALER connected to the controller, named by the worker's rank."""

    def __init__(self, controller_addr: str, rank: int) -> None:
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        _configure(self.dealer)
        self.dealer.setsockopt(zmq.IDENTITY, identity_of(rank))
        self._monitor = self.dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.dealer.connect(f"tcp://{controller_addr}")

    def send(self, kind: bytes, *frames: bytes) -> None:
        self.dealer.send_multipart([kind, *frames], copy=False)

    def recv(self) -> tuple[bytes, list[bytes]]:
        kind, *frames = self.dealer.recv_multipart()
        return kind, frames

    def watch_controller(self, on_lost: Callable[[], None]) -> None:
        """Call ``on_lost`` (on a daemon thread) when the controller goes away.

        A worker may be blocked inside a collective when that happens; this thread is what
        still notices, so no worker outlives its controller.
        """
        monitor = self._monitor

        def watch() -> None:
            recv_monitor_message(monitor)
            on_lost()

        threading.Thread(target=watch, name="controller-watch", daemon=True).start()

    def close(self, linger_ms: int = 1000) -> None:
        """Close, giving queued messages (a last ERROR) up to ``linger_ms`` to leave."""
        self.dealer.close(linger_ms)


def identity_of(rank: int) -> bytes:
    return f"rank-{rank}".encode()
