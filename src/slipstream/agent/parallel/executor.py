"""The controller's side of parallel execution: the model runner interface over the workers.

    LLMEngine.step --submit(batch)--> BATCH to every rank (ZeroMQ)
                   <--collect()------ RESULT from the sampler rank, in batch order

``execute(batch)`` (submit, then wait) serves the plain engine loop. With SPP the engine keeps
up to ``pipeline_depth`` batches in flight through ``submit``/``collect``. This is the
``Runner`` of ``agent/engine/step/runner.py``.

Grammars: when a batch has rows under a grammar, the engine passes its mask job. The batch
goes out first; then the controller finishes the masks (its helper thread started them before
the batch was sent) while the workers run the forward, and sends them to the sampler rank
alone (MASKS), which waits for them only once its logits are ready. The matchers stay with
the engine, so a token it drops (a request preempted while its token was in flight) or a
step it retries (failure isolation) never reaches a grammar's state.

What goes to the workers is a diff (``wire.py``): new requests in full, running ones only
their new tokens and new block ids; ``release`` tells the workers which requests left.

Failure handling: every wait polls in short slices and checks, between them, for a worker's
ERROR message, a dropped connection (socket monitor, heartbeats) and, for workers started
here, process exit. Any of those raises ``WorkerLost`` within about a second; nothing waits
on a dead worker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection

import torch

from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.errors import EngineDeadError
from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.engine.sampling.sampler import GrammarMasks, MaskSource
from slipstream.agent.parallel.env import NodeEnv
from slipstream.agent.parallel.launch import LocalWorkers, free_port
from slipstream.agent.parallel.stage_runner import StageSpan
from slipstream.agent.parallel.wire import BatchDiffer
from slipstream.agent.parallel.transport import (
    BATCH, ERROR, HELLO, INIT, MASKS, READY, RESULT, STOP, TRACE, TRACE_REPLY,
    ControllerSocket, PeerLost, decode_object, decode_sampled, encode_batch, encode_masks,
    encode_object, identity_of)
from slipstream.agent.parallel.worker import WorkerInit
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, TierResults

log = logging.getLogger(__name__)
POLL_S = 0.2
START_TIMEOUT_S = 600.0


class WorkerLost(EngineDeadError):
    """A worker process died, disconnected or reported an error."""


class ParallelExecutor:
    def __init__(self, config: EngineConfig, node_env: NodeEnv | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        parallel = config.parallel
        node_env = node_env or NodeEnv.from_environ()
        self.world_size = parallel.world_size
        if node_env.world_size not in (None, self.world_size):
            raise ValueError(f"SLIPSTREAM_WORLD_SIZE={node_env.world_size} but tp*ep*spp*kvp = "
                             f"{self.world_size}")
        if node_env.controller_addr:
            connect_addr = node_env.controller_addr
            bind_host, port = "*", int(connect_addr.rpartition(":")[2])
        else:
            bind_host, port = "127.0.0.1", free_port()
            connect_addr = f"127.0.0.1:{port}"
        local_ranks = (node_env.node_ranks if node_env.node_ranks is not None
                       else tuple(range(self.world_size)))
        self.pipeline_depth = parallel.spp
        self._sampler = identity_of(parallel.sampler_rank)
        self.last_forward_s = 0.0  # not measurable from here; kept for the runner interface
        self._next_seq = 0
        self._in_flight: deque[int] = deque()
        self._differ = BatchDiffer()
        self.last_batch_bytes = 0  # what the last submit sent to each worker
        self._closed = False
        # Workers first: they are forked, and the socket below starts ZeroMQ's I/O threads.
        # They keep retrying the connection until the socket is bound.
        self.workers = LocalWorkers(local_ranks, self.world_size, connect_addr,
                                    node_env.master_addr or "127.0.0.1",
                                    node_env.master_port or free_port()) if local_ranks else None
        try:
            self.socket = ControllerSocket(bind_host, port)
            self.num_kv_blocks = self._start(config, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        joined: set[bytes] = set()
        while len(joined) < self.world_size:
            identity, _, _ = self._expect(HELLO, deadline)
            joined.add(identity)
        self.socket.identities = sorted(joined)
        self.socket.broadcast(INIT, encode_object(WorkerInit(config)))
        blocks: dict[bytes, int] = {}
        while len(blocks) < self.world_size:
            identity, _, frames = self._expect(READY, deadline)
            blocks[identity] = decode_object(frames[0])
        log.info("%d workers ready; %d KV blocks per rank", self.world_size, min(blocks.values()))
        return min(blocks.values())

    def _expect(self, kind: bytes, deadline: float) -> tuple[bytes, bytes, list[bytes]]:
        while time.monotonic() < deadline:
            message = self._recv(POLL_S)
            if message is None:
                continue
            if message[1] != kind:
                raise WorkerLost(f"unexpected message {message[1]!r} while waiting for {kind!r}")
            return message
        raise WorkerLost(f"workers did not start within the timeout (waiting for {kind!r})")

    def _recv(self, timeout_s: float) -> tuple[bytes, bytes, list[bytes]] | None:
        try:
            message = self.socket.recv(timeout_s)
        except PeerLost as error:
            raise WorkerLost(str(error)) from None
        if message is None:
            self._check_processes()
            return None
        identity, kind, frames = message
        if kind == ERROR:
            raise WorkerLost(f"worker {identity.decode()} failed: {frames[0].decode()}")
        return message

    def _check_processes(self) -> None:
        exited = self.workers.exited() if self.workers is not None else {}
        if exited:
            raise WorkerLost(f"worker process exited: rank(s) and exit codes {exited}")

    # -- the runner interface ---------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, batch: Batch, masks: MaskSource | None = None) -> int:
        """Send ``batch`` to every rank; with ``masks`` (the grammar masks of its guided
        rows), finish them while the workers compute and send them to the sampler rank."""
        seq = self._next_seq
        self._next_seq += 1
        frames = encode_batch(seq, self._differ.diff(batch, masked=masks is not None))
        self.last_batch_bytes = sum(len(frame) for frame in frames)
        try:
            self.socket.broadcast(BATCH, *frames)
            self._in_flight.append(seq)
            if masks is not None:
                self.socket.send(self._sampler, MASKS, *self._masks_frames(seq, batch, masks))
        except PeerLost as error:
            raise WorkerLost(str(error)) from None
        return seq

    @staticmethod
    def _masks_frames(seq: int, batch: Batch, masks: MaskSource) -> list[bytes]:
        """The step's masks on the wire. If computing them fails, the guided rows fail
        alone: the sampler rank is waiting for this step's masks either way."""
        try:
            return encode_masks(seq, masks() or _no_masks())
        except Exception:  # noqa: BLE001 - fail the guided rows, spare the batch
            log.exception("computing grammar masks failed; this step's requests under a "
                          "grammar fail")
            sampling = [chunk for chunk in batch.chunks if chunk.sample]
            return encode_masks(seq, _no_masks([row for row, chunk in enumerate(sampling)
                                                if chunk.sampling.guided]))

    def collect(self, block: bool) -> list[tuple[int, dict[str, SampledToken]]]:
        """Results that have arrived, oldest first; with ``block``, wait for at least one."""
        results: list[tuple[int, dict[str, SampledToken]]] = []
        while self._in_flight:
            message = self._recv(POLL_S if block and not results else 0.0)
            if message is None:
                if block and not results:
                    continue
                break
            if message[1] != RESULT:
                raise WorkerLost(f"unexpected message {message[1]!r} from a worker")
            seq, sampled = decode_sampled(message[2])
            self._in_flight.remove(seq)
            results.append((seq, sampled))
        return results

    def release(self, request_ids: Collection[str]) -> None:
        self._differ.release(request_ids)

    def allocate_host_cache(self, num_blocks: int) -> None:
        raise ValueError("swap preemption is not supported with parallel workers yet; "
                         "use --preemption recompute")

    def enable_kv_tiers(self, settings: KVTierSettings, host_load_gb_per_s: float = 0.0,
                        disk_read_gb_per_s: float = 0.0) -> KVTierConfig | None:
        raise ValueError("KV tiers (--kv-host-memory) are not supported with parallel "
                         "workers yet")

    def poll_kv_tiers(self) -> TierResults:
        return TierResults()

    def kv_tier_counters(self) -> dict[str, float]:
        return {}

    def check_alive(self) -> None:
        """Raise ``WorkerLost`` if a worker is gone. Only while idle: ``collect`` watches
        while batches are in flight."""
        if not self._in_flight and self._recv(0.0) is not None:
            raise WorkerLost("a worker sent a message while the pipeline was idle")

    def execute(self, batch: Batch, masks: MaskSource | None = None
                ) -> dict[str, SampledToken]:
        seq = self.submit(batch, masks)
        while True:
            for done_seq, sampled in self.collect(block=True):
                if done_seq == seq:
                    return sampled

    def traces(self) -> list[StageSpan]:
        """Every rank's recorded compute spans (call with nothing in flight)."""
        if self._in_flight:
            raise RuntimeError("traces() needs an idle pipeline")
        self.socket.broadcast(TRACE)
        spans: list[StageSpan] = []
        deadline = time.monotonic() + 30.0
        for _ in range(self.world_size):
            spans.extend(decode_object(self._expect(TRACE_REPLY, deadline)[2][0]))
        return spans

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        socket = getattr(self, "socket", None)
        try:
            if socket is not None and socket.identities:
                socket.broadcast(STOP)
        except PeerLost:
            pass
        if self.workers is not None:
            self.workers.stop()
        if socket is not None:
            socket.close()


def _no_masks(dead_rows: list[int] | None = None) -> GrammarMasks:
    """No row masked; ``dead_rows`` fail."""
    return GrammarMasks(rows=[], allowed=torch.empty(0, 0, dtype=torch.int32),
                        dead_rows=dead_rows or [])
