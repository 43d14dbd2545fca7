"""Workload traces for the simulator and the load generator: who arrives when, with how much.

    Azure CSV | Mooncake JSONL | length file + Poisson/gamma arrivals | mixture
        --> list[TraceRequest] (sorted by arrival) --> scale_to_qps() --> simulator / bench serve

Every reader returns the same small record, arrival times in seconds from the first request.
Scaling to a target rate compresses or stretches the arrival times and keeps the lengths and
the burst pattern, which is how a recorded trace is replayed "at 2x load".
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from slipstream.sim.datasets import open_text

HASH_BLOCK_TOKENS = 512  # tokens per Mooncake hash id


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    source: str = ""  # which trace or recipe component it came from
    # Content ids of the prompt's blocks of HASH_BLOCK_TOKENS tokens (Mooncake's hash_ids):
    # equal ids are equal tokens. Empty: the prompt shares nothing with any other.
    hash_ids: tuple[int, ...] = ()


def read_azure_csv(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Azure LLM inference trace 2023: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (``.xz`` or
    plain, as every reader here)."""
    rows: list[tuple[datetime, int, int]] = []
    with open_text(Path(path)) as handle:
        for row in csv.DictReader(handle):
            # Seven fractional digits: Python parses at most six.
            stamp = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        return []
    start = min(stamp for stamp, _, _ in rows)
    requests = [TraceRequest((stamp - start).total_seconds(), max(1, prompt), max(1, output),
                             "azure") for stamp, prompt, output in rows]
    return sorted(requests, key=lambda r: r.arrival_s)


def read_mooncake_jsonl(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Mooncake conversation trace: ``timestamp`` (ms), ``input_length``, ``output_length``
    and ``hash_ids`` (one per 512-token block of the prompt)."""
    requests = []
    with open_text(Path(path)) as handle:
        for line in handle:
            if not line.strip():
                continue
            row = json.loads(line)
            requests.append(TraceRequest(row["timestamp"] / 1000.0, max(1, row["input_length"]),
                                         max(1, row["output_length"]), "mooncake",
                                         tuple(row.get("hash_ids") or ())))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        return []
    start = min(r.arrival_s for r in requests)
    return sorted((replace(r, arrival_s=r.arrival_s - start) for r in requests),
                  key=lambda r: r.arrival_s)


def read_length_file(path: Path) -> list[tuple[int, int]]:
    """(prompt, output) rows of a vajra/vidur length CSV (``num_prefill_tokens,...``)."""
    with open_text(Path(path)) as handle:
        return [(max(1, int(row["num_prefill_tokens"])), max(1, int(row["num_decode_tokens"])))
                for row in csv.DictReader(handle)]


def arrival_times(rng: np.random.Generator, count: int, qps: float,
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival times of ``count`` requests at mean rate ``qps``.

    Gaps are gamma distributed with shape ``burstiness`` and scale ``1 / (qps * burstiness)``,
    as vLLM's ``--burstiness``: 1 is a Poisson process, below 1 burstier, above 1 smoother.
    """
    if qps <= 0 or burstiness <= 0:
        raise ValueError("qps and burstiness must be > 0")
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (qps * burstiness), size=count)
    return np.cumsum(gaps) - gaps[0]  # the first request arrives at 0


def synthesize(lengths: list[tuple[int, int]], count: int, qps: float, seed: int,
               burstiness: float = 1.0, source: str = "lengths") -> list[TraceRequest]:
    """``count`` requests with lengths drawn (with replacement) from ``lengths``."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(lengths), size=count)
    times = arrival_times(rng, count, qps, burstiness)
    return [TraceRequest(float(at), lengths[i][0], lengths[i][1], source)
            for at, i in zip(times.tolist(), picks.tolist())]


def scale_to_qps(requests: list[TraceRequest], qps: float) -> list[TraceRequest]:
    """Stretch or compress arrival times so the mean rate over the trace is ``qps``."""
    if len(requests) < 2 or qps <= 0:
        return list(requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        return list(requests)
    factor = (len(requests) - 1) / span / qps
    start = requests[0].arrival_s
    return [replace(r, arrival_s=(r.arrival_s - start) * factor) for r in requests]


def first_seconds(requests: list[TraceRequest], duration_s: float) -> list[TraceRequest]:
    return [r for r in requests if r.arrival_s < duration_s]


def mix(parts: list[list[TraceRequest]]) -> list[TraceRequest]:
    """Interleave traces by arrival time (each keeps its own clock)."""
    return sorted((r for part in parts for r in part), key=lambda r: r.arrival_s)


def mean_qps(requests: list[TraceRequest]) -> float:
    if len(requests) < 2:
        return 0.0
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


RateCurve = Callable[[np.ndarray], np.ndarray]  # seconds -> requests per second


def diurnal_rate(trough_qps: float, peak_qps: float, day_s: float) -> RateCurve:
    """A daily rate curve: ``trough`` at midnight (t = 0), ``peak`` at noon, a raised cosine
    in between."""
    if not 0 < trough_qps <= peak_qps or day_s <= 0:
        raise ValueError("need 0 < trough_qps <= peak_qps and day_s > 0")

    def rate(t_s: np.ndarray) -> np.ndarray:
        return trough_qps + (peak_qps - trough_qps) * (1 - np.cos(2 * np.pi * t_s / day_s)) / 2

    return rate


def step_rate(low_qps: float, high_qps: float, up_at_s: float, down_at_s: float) -> RateCurve:
    """``low``, then ``high`` from ``up_at_s`` until ``down_at_s``, then ``low`` again."""
    if not 0 < low_qps and up_at_s < down_at_s:
        raise ValueError("need low_qps > 0 and up_at_s < down_at_s")

    def rate(t_s: np.ndarray) -> np.ndarray:
        return np.where((t_s >= up_at_s) & (t_s < down_at_s), high_qps, low_qps)

    return rate


def merge_streams(requests: list[TraceRequest], streams: int) -> list[TraceRequest]:
    """``streams`` copies of a recorded trace played side by side: copy ``k`` shifted by
    ``k / streams`` of the trace's length (wrapping around), merged in time order. The
    result is a population ``streams`` times the trace's, each part at the trace's own
    pace, with ``streams`` times its rate and the same lengths.

    Why: replaying one trace ``streams`` times faster instead also plays its content drift
    (the Azure conversation hour's mean prompt over 800 consecutive requests ranges from
    834 to 1,451 tokens) that many times faster, so the prefill work swings by a quarter
    within a minute; a service with that many times the users averages over more sessions
    and changes at the trace's pace."""
    if streams < 1:
        raise ValueError("streams must be at least 1")
    if streams == 1 or len(requests) < 2:
        return list(requests)
    first = requests[0].arrival_s
    offsets = [r.arrival_s - first for r in requests]
    period = offsets[-1] * len(requests) / (len(requests) - 1)  # a mean gap after the last
    merged = [replace(r, arrival_s=(offset + k * period / streams) % period)
              for k in range(streams) for r, offset in zip(requests, offsets)]
    merged.sort(key=lambda r: r.arrival_s)
    return merged


def warp_to_rate(requests: list[TraceRequest], rate: RateCurve, duration_s: float,
                 grid_s: float = 1.0, smooth_s: float = 120.0) -> list[TraceRequest]:
    """Replay a trace under a time-varying rate: the trace's own short-term arrival pattern,
    bent to follow ``rate(t)`` over ``[0, duration_s)``.

    The trace (repeated end to end as often as needed) is put on its operational clock: a
    request at ``a`` seconds gets ``u = N(a)``, where ``N`` counts the trace's arrivals
    smoothed over ``smooth_s``. ``u`` grows by one per request on average, so the trace's
    own drift over minutes (the Azure hour is not flat) is taken out, while its bursts and
    lulls shorter than ``smooth_s`` stay. The request then lands at ``t = L^-1(u)``, where
    ``L(t)`` is the expected count of arrivals by ``t`` under ``rate``: the long-run rate is
    the curve's. Lengths are the trace's, in its order."""
    if len(requests) < 2:
        raise ValueError("warp_to_rate needs a trace of at least two requests")
    first = requests[0].arrival_s
    offsets = np.array([r.arrival_s - first for r in requests])
    mean_qps = (len(requests) - 1) / max(offsets[-1], 1e-9)
    grid = np.arange(0.0, duration_s + grid_s, grid_s)
    expected = np.concatenate(([0.0], np.cumsum(rate(grid[:-1]) * grid_s)))
    loops = int(expected[-1] // len(requests)) + 2
    loop_s = offsets[-1] + 1.0 / mean_qps
    trace_s = np.concatenate([offsets + k * loop_s for k in range(loops)])
    edges = np.arange(0.0, trace_s[-1] + 2 * grid_s, grid_s)
    counts, _ = np.histogram(trace_s, bins=edges)
    width = max(1, int(round(smooth_s / grid_s)))
    padded = np.pad(counts.astype(np.float64), (width, width), mode="wrap")
    smoothed = np.convolve(padded, np.ones(width) / width, mode="same")[width:-width]
    operational = np.concatenate(([0.0], np.cumsum(smoothed)))
    counts_at = np.interp(trace_s, edges, operational)
    counts_at = counts_at[counts_at < expected[-1]]
    times = np.interp(counts_at, expected, grid)
    return [replace(requests[i % len(requests)], arrival_s=float(t))
            for i, t in enumerate(times)]
