"""Cost of the controller -> worker hop per engine iteration: serialization plus ZeroMQ.

What one iteration pays on top of the forward pass under parallelism: encode the batch,
send it to every worker, each worker decodes it; the sampler rank encodes the sampled tokens
and sends them back; the controller decodes them. Measured with the real transport classes
(``agent/parallel/transport.py``) and echo workers that skip the model, one batch in flight
at a time, at 1 and 8 workers, side by side in one run for:

- ``msgspec-diff``: what the engine sends now (``agent/parallel/wire.py``): a decode step of
  running requests carries their new token and new block ids only; the workers keep the
  tables (steady state: the workers already know every request);
- ``msgspec-full``: the whole ``Batch`` with every request's whole block table, msgpack (what
  the engine sent before the diff);
- ``pickle-full``: the same whole ``Batch``, pickled.

It also records the bytes one decode step of a single request puts on the wire per worker
at contexts from 1K to 1M tokens, whole table vs diff.

Writes ``transport_bench.json`` and ``transport_bench.png`` under ``--out``. Usage::

    python -m slipstream.bench.transport_bench --out results/transport
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.parallel.launch import free_port
from slipstream.agent.parallel.transport import (
    BATCH, HELLO, RESULT, STOP, ControllerSocket, WorkerSocket, decode_batch, decode_sampled,
    encode_batch, encode_sampled)
from slipstream.agent.parallel.wire import BatchDiffer, WorkerTables
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE

_full_encoder = msgspec.msgpack.Encoder()
_full_decoder = msgspec.msgpack.Decoder(Batch)


class Codec:
    """One way to put a batch on the wire: a controller end and a worker end, each with the
    state it keeps between steps (none for the whole-batch codecs)."""

    def __init__(self, name: str) -> None:
        if name not in CODECS:
            raise ValueError(f"unknown codec {name!r}; one of {CODECS}")
        self.name = name
        self.differ = BatchDiffer()
        self.tables = WorkerTables()

    def encode(self, seq: int, batch: Batch) -> list[bytes]:
        if self.name == "msgspec-diff":
            return encode_batch(seq, self.differ.diff(batch))
        if self.name == "msgspec-full":
            return [seq.to_bytes(8, "little"), _full_encoder.encode(batch)]
        return [pickle.dumps((seq, batch), protocol=5)]

    def decode(self, frames: list[bytes]) -> tuple[int, Batch]:
        if self.name == "msgspec-diff":
            seq, wire = decode_batch(frames)
            return seq, self.tables.apply(wire)
        if self.name == "msgspec-full":
            return int.from_bytes(frames[0], "little"), _full_decoder.decode(frames[1])
        return pickle.loads(frames[0])  # noqa: S301 - our own bytes

    def encode_reply(self, seq: int, sampled: dict[str, SampledToken]) -> list[bytes]:
        if self.name == "pickle-full":
            return [pickle.dumps((seq, sampled), protocol=5)]
        return encode_sampled(seq, sampled)

    def decode_reply(self, frames: list[bytes]) -> tuple[int, dict[str, SampledToken]]:
        if self.name == "pickle-full":
            return pickle.loads(frames[0])  # noqa: S301 - our own bytes
        return decode_sampled(frames)


CODECS = ("msgspec-diff", "msgspec-full", "pickle-full")


def decode_batch_of(batch_size: int, context_tokens: int) -> Batch:
    """``batch_size`` decodes, each with the block table of a ``context_tokens`` context."""
    blocks = -(-context_tokens // BLOCK_SIZE)
    return Batch(chunks=tuple(
        ScheduledChunk(f"cmpl-{index:032x}", (1000 + index,), context_tokens - 1,
                       tuple(range(index * blocks, (index + 1) * blocks)), True,
                       SamplingOptions(temperature=0.0), num_generated=17)
        for index in range(batch_size)))


def echo_worker(address: str, rank: int, codec_name: str, replies: bool) -> None:
    codec = Codec(codec_name)
    sock = WorkerSocket(address, rank)
    sock.send(HELLO)
    while True:
        kind, frames = sock.recv()
        if kind == STOP:
            break
        seq, batch = codec.decode(frames)
        if replies:
            sampled = {chunk.request_id: SampledToken(7) for chunk in batch.chunks}
            sock.send(RESULT, *codec.encode_reply(seq, sampled))
    sock.close()


def measure_round_trips(codec_name: str, num_workers: int, batch: Batch,
                        iterations: int) -> list[float]:
    codec = Codec(codec_name)
    port = free_port()
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=echo_worker,
                               args=(f"127.0.0.1:{port}", rank, codec_name, rank == 0))
               for rank in range(num_workers)]
    for worker in workers:
        worker.start()
    controller = ControllerSocket("127.0.0.1", port)
    try:
        while len(controller.identities) < num_workers:
            message = controller.recv(timeout_s=30.0)
            if message is None:
                raise RuntimeError("echo workers did not connect")
            controller.identities.append(message[0])
        times_s = []
        for seq in range(iterations):
            started = time.perf_counter()
            controller.broadcast(BATCH, *codec.encode(seq, batch))
            while (message := controller.recv(timeout_s=10.0)) is None:
                pass
            _, sampled = codec.decode_reply(message[2])
            times_s.append(time.perf_counter() - started)
            assert len(sampled) == len(batch.chunks)
        controller.broadcast(STOP)
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
        controller.close()
    return times_s


def codec_costs_us(codec_name: str, batch: Batch, iterations: int) -> dict[str, float]:
    """Encode + decode per step (controller and one worker, no sockets), in steady state."""
    codec = Codec(codec_name)
    codec.decode(codec.encode(0, batch))  # the first step teaches the workers the tables
    sampled = {chunk.request_id: SampledToken(7) for chunk in batch.chunks}
    started = time.perf_counter()
    for seq in range(iterations):
        codec.decode(codec.encode(seq, batch))
    batch_us = (time.perf_counter() - started) / iterations * 1e6
    started = time.perf_counter()
    for seq in range(iterations):
        codec.decode_reply(codec.encode_reply(seq, sampled))
    reply_us = (time.perf_counter() - started) / iterations * 1e6
    return {"batch_encode_decode_us": batch_us, "result_encode_decode_us": reply_us,
            "batch_bytes": sum(len(f) for f in codec.encode(1, batch))}


def bytes_per_step(context_tokens: int) -> dict[str, int]:
    """One request decoding from ``context_tokens``: bytes per worker per step, steady state."""
    batch = decode_batch_of(1, context_tokens)
    sizes = {}
    for name in CODECS:
        codec = Codec(name)
        codec.encode(0, batch)
        sizes[name] = sum(len(frame) for frame in codec.encode(1, batch))
    return sizes


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    contexts = [int(c) for c in report["bytes_per_step"]]
    for name in CODECS:
        left.plot(contexts, [report["bytes_per_step"][str(c)][name] for c in contexts],
                  marker="o", label=name)
    left.set(xscale="log", yscale="log", xlabel="context tokens of the request",
             ylabel="bytes per decode step, per worker",
             title="One request's step on the wire")
    left.legend()
    keys = list(report["round_trip"])
    right.barh(keys, [report["round_trip"][k]["median_ms"] for k in keys])
    right.set(xlabel="median round trip (ms)",
              title=f"{report['batch_size']} decodes x {report['context_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(times_s: list[float]) -> dict[str, float]:
    ordered = sorted(times_s)
    return {"median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": ordered[int(0.9 * len(ordered))] * 1e3,
            "p99_ms": ordered[int(0.99 * len(ordered))] * 1e3,
            "mean_ms": statistics.fmean(ordered) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("results/transport"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-tokens", type=int, default=1024,
                        help="context per request: sets the block table each chunk carries")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--step-bytes-contexts", type=int, nargs="+",
                        default=[1024, 16384, 131072, 1 << 20],
                        help="contexts at which to record one request's bytes per step")
    args = parser.parse_args(argv)
    batch = decode_batch_of(args.batch_size, args.context_tokens)
    report: dict = {"batch_size": args.batch_size, "context_tokens": args.context_tokens,
                    "iterations": args.iterations, "machine": platform.platform(),
                    "processor": platform.processor(), "codecs": {}, "round_trip": {},
                    "bytes_per_step": {str(c): bytes_per_step(c)
                                       for c in args.step_bytes_contexts}}
    for codec in CODECS:
        report["codecs"][codec] = codec_costs_us(codec, batch, args.iterations)
        for num_workers in args.workers:
            times_s = measure_round_trips(codec, num_workers, batch, args.iterations + 100)[100:]
            report["round_trip"][f"{codec}/{num_workers}_workers"] = summarize(times_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport_bench.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "transport_bench.png")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
