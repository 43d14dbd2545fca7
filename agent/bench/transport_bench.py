"""Cost of the controller -> worker hop per engine iteration: serialization plus ZeroMQ.

What one iteration pays on top of the forward pass under parallelism: encode the ``Batch``,
send it to every worker, each worker decodes it; the sampler rank encodes the sampled tokens
and sends them back; the controller decodes them. Measured with the real transport classes
(``agent/parallel/transport.py``) and echo workers that skip the model, one batch in flight
at a time, for msgspec (what the engine uses) and pickle, at 1 and 8 workers.

Writes ``transport_bench.json`` under ``--out``. Usage::

    python -m slipstream.agent.bench.transport_bench --out results/transport
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

from slipstream.agent.engine.model_runner import SampledToken
from slipstream.agent.parallel.launch import free_port
from slipstream.agent.parallel.transport import (
    BATCH, HELLO, RESULT, STOP, ControllerSocket, WorkerSocket, decode_batch, decode_sampled,
    encode_batch, encode_sampled)
from slipstream.agent.scheduler.batch import Batch, SamplingOptions, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE

CODECS = {
    "msgspec": (encode_batch, decode_batch, encode_sampled, decode_sampled),
    "pickle": (lambda seq, batch: [pickle.dumps((seq, batch), protocol=5)],
               lambda frames: pickle.loads(frames[0]),
               lambda seq, sampled: [pickle.dumps((seq, sampled), protocol=5)],
               lambda frames: pickle.loads(frames[0])),
}


def decode_batch_of(batch_size: int, context_tokens: int) -> Batch:
    """``batch_size`` decodes, each with the block table of a ``context_tokens`` context."""
    blocks = -(-context_tokens // BLOCK_SIZE)
    return Batch(chunks=tuple(
        ScheduledChunk(f"cmpl-{index:032x}", (1000 + index,), context_tokens - 1,
                       tuple(range(index * blocks, (index + 1) * blocks)), True,
                       SamplingOptions(temperature=0.0), num_generated=17)
        for index in range(batch_size)))


def echo_worker(address: str, rank: int, codec: str, replies: bool) -> None:
    _, decode, encode_reply, _ = CODECS[codec]
    sock = WorkerSocket(address, rank)
    sock.send(HELLO)
    while True:
        kind, frames = sock.recv()
        if kind == STOP:
            break
        seq, batch = decode(frames)
        if replies:
            sampled = {chunk.request_id: SampledToken(7) for chunk in batch.chunks}
            sock.send(RESULT, *encode_reply(seq, sampled))
    sock.close()


def measure_round_trips(codec: str, num_workers: int, batch: Batch,
                        iterations: int) -> list[float]:
    encode, _, _, decode_reply = CODECS[codec]
    port = free_port()
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=echo_worker,
                               args=(f"127.0.0.1:{port}", rank, codec, rank == 0))
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
            controller.broadcast(BATCH, *encode(seq, batch))
            while (message := controller.recv(timeout_s=10.0)) is None:
                pass
            _, sampled = decode_reply(message[2])
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


def codec_costs_us(codec: str, batch: Batch, iterations: int) -> dict[str, float]:
    encode, decode, encode_reply, decode_reply = CODECS[codec]
    sampled = {chunk.request_id: SampledToken(7) for chunk in batch.chunks}
    started = time.perf_counter()
    for seq in range(iterations):
        decode(encode(seq, batch))
    batch_us = (time.perf_counter() - started) / iterations * 1e6
    started = time.perf_counter()
    for seq in range(iterations):
        decode_reply(encode_reply(seq, sampled))
    reply_us = (time.perf_counter() - started) / iterations * 1e6
    return {"batch_encode_decode_us": batch_us, "result_encode_decode_us": reply_us,
            "batch_bytes": sum(len(f) for f in encode(0, batch))}


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
    args = parser.parse_args(argv)
    batch = decode_batch_of(args.batch_size, args.context_tokens)
    report: dict = {"batch_size": args.batch_size, "context_tokens": args.context_tokens,
                    "iterations": args.iterations, "machine": platform.platform(),
                    "processor": platform.processor(), "codecs": {}, "round_trip": {}}
    for codec in CODECS:
        report["codecs"][codec] = codec_costs_us(codec, batch, args.iterations)
        for num_workers in args.workers:
            times_s = measure_round_trips(codec, num_workers, batch, args.iterations + 100)[100:]
            report["round_trip"][f"{codec}/{num_workers}_workers"] = summarize(times_s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport_bench.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
