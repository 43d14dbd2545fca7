"""Named workloads: the shipped traces (``datasets.py``) and recipes built from them.

    --trace azure | mooncake | FILE        recorded arrivals and lengths
    --lengths sharegpt[=W] arxiv[=W] ...   lengths drawn from files, synthetic arrivals
    --recipe medha-mixed                   Medha's mixed workload (below)
    --recipe sharegpt-short                ShareGPT requests with short prompts only (below)
    --recipe multi-turn-docs               conversations over shared long documents (below)
        --> WorkloadSpec --> build_workload() --> list[TraceRequest]

Medha's mixed workload (Medha section 6.2): ShareGPT-length requests with a 5% share of long
requests of 128K-1M prompt tokens. Medha's long requests come from its Medha-SWE trace
(prefill P50 393K, P90 839K; decode P50 518, P90 808), which is not public. We draw long
prompts log-uniformly in [128K, 1M], whose P50 (362K) and P90 (814K) are close to those, and
long outputs log-normally with the same median and P90 as Medha-SWE's decodes. Exactly
``round(5% * count)`` requests are long, at random positions in a Poisson stream.

``sharegpt-short``: the ShareGPT rows whose prompt is at most 256 tokens (about 17% of them),
with their own output lengths, in a Poisson stream. That is the short-prefill regime PLA-Serve
batches with Adaptive Wait-Depth (its Figure 5 uses prompts under 256 tokens).

``multi-turn-docs``: the workload this project exists for, for prefix caching where a trace
has no hashes. A few long documents (8K-32K tokens, log-uniform); each conversation picks one
and asks questions (30-200 tokens) about it, each answered (ShareGPT-like output lengths), the
next turn's prompt being the whole conversation so far. Conversations start in a Poisson
stream and take a think time (exponential, 20 s mean) between turns. Prompts carry
Mooncake-style ``hash_ids`` (one per 512-token block): a block wholly inside the document has
the document's id for that position, any later block the conversation's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from slipstream.sim.datasets import data_path, open_text, trace_format
from slipstream.sim.traces import (
    HASH_BLOCK_TOKENS,
    TraceRequest,
    arrival_times,
    first_seconds,
    read_azure_csv,
    read_length_file,
    read_mooncake_jsonl,
    scale_to_qps,
)

RECIPES = ("medha-mixed", "sharegpt-short", "multi-turn-docs")
SHORT_PROMPT_MAX_TOKENS = 256

MEDHA_LONG_FRACTION = 0.05
MEDHA_LONG_MIN_TOKENS = 128 * 1024
MEDHA_LONG_MAX_TOKENS = 1024 * 1024
MEDHA_LONG_OUTPUT_P50_TOKENS = 518
MEDHA_LONG_OUTPUT_P90_TOKENS = 808
Z_90 = 1.2815515655446004  # standard normal quantile at 0.9


def read_trace(name_or_path: str, limit: int | None = None) -> list[TraceRequest]:
    path = data_path(name_or_path)
    if trace_format(path) == ".jsonl":
        return read_mooncake_jsonl(path, limit)
    with open_text(path) as handle:
        header = handle.readline()
    if header.startswith("TIMESTAMP"):
        return read_azure_csv(path, limit)
    raise ValueError(f"{path}: not an Azure CSV or Mooncake JSONL trace (lengths files need "
                     "--lengths and synthetic arrivals)")


def medha_mixed(count: int, qps: float, seed: int, burstiness: float = 1.0,
                long_fraction: float = MEDHA_LONG_FRACTION,
                short_lengths: list[tuple[int, int]] | None = None) -> list[TraceRequest]:
    """Medha's mixed workload: ShareGPT lengths plus ``long_fraction`` of 128K-1M prompts."""
    if short_lengths is None:
        short_lengths = read_length_file(data_path("sharegpt"))
    rng = np.random.default_rng(seed)
    times = arrival_times(rng, count, qps, burstiness).tolist()
    num_long = round(long_fraction * count)
    long_positions = set(rng.choice(count, size=num_long, replace=False).tolist())
    log_min, log_max = math.log(MEDHA_LONG_MIN_TOKENS), math.log(MEDHA_LONG_MAX_TOKENS)
    sigma = math.log(MEDHA_LONG_OUTPUT_P90_TOKENS / MEDHA_LONG_OUTPUT_P50_TOKENS) / Z_90
    requests = []
    for index, at in enumerate(times):
        if index in long_positions:
            prompt = int(math.exp(rng.uniform(log_min, log_max)))
            output = int(rng.lognormal(math.log(MEDHA_LONG_OUTPUT_P50_TOKENS), sigma))
            requests.append(TraceRequest(at, prompt, max(1, output), "medha-long"))
        else:
            prompt, output = short_lengths[int(rng.integers(len(short_lengths)))]
            requests.append(TraceRequest(at, prompt, output, "sharegpt"))
    return requests


def sharegpt_short(count: int, qps: float, seed: int,
                   burstiness: float = 1.0) -> list[TraceRequest]:
    """ShareGPT lengths with prompts of at most ``SHORT_PROMPT_MAX_TOKENS``, Poisson arrivals."""
    rows = [(prompt, output) for prompt, output in read_length_file(data_path("sharegpt"))
            if prompt <= SHORT_PROMPT_MAX_TOKENS]
    rng = np.random.default_rng(seed)
    times = arrival_times(rng, count, qps, burstiness).tolist()
    picks = rng.integers(len(rows), size=count).tolist()
    return [TraceRequest(at, rows[pick][0], rows[pick][1], "sharegpt-short")
            for at, pick in zip(times, picks)]


@dataclass(frozen=True)
class WorkloadSpec:
    """What ``slipstream simulate`` (and ``bench serve``) was asked to replay."""

    trace: str | None = None  # azure, mooncake or a file
    lengths: tuple[tuple[str, float], ...] = ()  # (file or name, weight)
    recipe: str | None = None
    qps: float | None = None  # None: the trace's own rate (required for synthetic arrivals)
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0
    max_prompt_tokens: int | None = None  # drop requests longer than the model's context
    # Every request generates this many tokens (1: a prefill-only instance, as the prefill
    # side of a prefill/decode-disaggregated deployment); None keeps the workload's lengths.
    output_tokens: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        chosen = sum(x is not None and x != () for x in (self.trace, self.lengths, self.recipe))
        if chosen != 1:
            raise ValueError("give exactly one of a trace, length files or a recipe")
        if self.recipe is not None and self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; known: {RECIPES}")
        if self.trace is None and self.qps is None:
            raise ValueError("synthetic arrivals need --qps")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")


def build_workload(spec: WorkloadSpec) -> list[TraceRequest]:
    if spec.trace is not None:
        requests = read_trace(spec.trace)
        if spec.qps is not None:
            requests = scale_to_qps(requests, spec.qps)
    else:
        qps = spec.qps
        assert qps is not None, "__post_init__: synthetic arrivals need a rate"
        count = spec.num_requests or _count_for(spec, qps)
        if spec.recipe == "medha-mixed":
            requests = medha_mixed(count, qps, spec.seed, spec.burstiness)
        elif spec.recipe == "sharegpt-short":
            requests = sharegpt_short(count, qps, spec.seed, spec.burstiness)
        elif spec.recipe == "multi-turn-docs":
            requests = multi_turn_docs(count, qps, spec.seed, **spec.extra)
        else:
            requests = _from_length_files(spec, count, qps)
    if spec.duration_s is not None:
        requests = first_seconds(requests, spec.duration_s)
    if spec.num_requests is not None:
        requests = requests[: spec.num_requests]
    if spec.output_tokens is not None:
        requests = [replace(r, output_tokens=spec.output_tokens) for r in requests]
    if spec.max_prompt_tokens is not None:
        requests = [r for r in requests if r.prompt_tokens + r.output_tokens <= spec.max_prompt_tokens]
    return requests


def multi_turn_docs(count: int, qps: float, seed: int, documents: int = 8,
                    turns: int = 6, think_s: float = 20.0) -> list[TraceRequest]:
    """``count`` requests of conversations over shared documents (module docstring);
    ``qps`` is the mean request rate."""
    rng = np.random.default_rng(seed)
    doc_tokens = np.exp(rng.uniform(math.log(8192), math.log(32768), size=documents)).astype(int)
    conversations = max(1, -(-count // turns))
    starts = arrival_times(rng, conversations, qps / turns).tolist()
    requests: list[TraceRequest] = []
    block = HASH_BLOCK_TOKENS
    for conversation, start_s in enumerate(starts):
        doc = int(rng.integers(documents))
        length, at = int(doc_tokens[doc]), start_s
        for _ in range(turns):
            length += int(rng.integers(30, 201))  # the question
            blocks = -(-length // block)
            ids = tuple(doc * 1_000_000 + j if (j + 1) * block <= doc_tokens[doc]
                        else 10**9 + conversation * 10_000 + j for j in range(blocks))
            output = int(min(2048, max(8, rng.lognormal(math.log(200), 0.8))))
            requests.append(TraceRequest(at, length, output, "multi-turn-docs", ids))
            length += output  # the answer is part of the next turn's prompt
            at += float(rng.exponential(think_s))
    requests.sort(key=lambda r: r.arrival_s)
    return requests[:count]


def _count_for(spec: WorkloadSpec, qps: float) -> int:
    if spec.duration_s is None:
        raise ValueError("synthetic arrivals need --num-requests or --duration-s")
    # Enough for the duration even in a slow stretch; first_seconds() trims the rest.
    expected = qps * spec.duration_s
    return int(expected + 6 * math.sqrt(expected / min(spec.burstiness, 1.0)) + 10)


def _from_length_files(spec: WorkloadSpec, count: int, qps: float) -> list[TraceRequest]:
    rng = np.random.default_rng(spec.seed)
    tables = [(name, read_length_file(data_path(name))) for name, _ in spec.lengths]
    weights = np.array([weight for _, weight in spec.lengths], dtype=np.float64)
    choices = rng.choice(len(tables), size=count, p=weights / weights.sum()).tolist()
    times = arrival_times(rng, count, qps, spec.burstiness).tolist()
    requests = []
    for at, which in zip(times, choices):
        name, rows = tables[which]
        prompt, output = rows[int(rng.integers(len(rows)))]
        requests.append(TraceRequest(at, prompt, output, _source_name(name)))
    return requests


def _source_name(name_or_path: str) -> str:
    """``sharegpt`` for a shipped trace, the bare file name for a path (``a.csv.xz`` -> ``a``)."""
    return Path(name_or_path).name.removesuffix(".xz").rsplit(".", 1)[0]


def parse_weighted(items: list[str]) -> tuple[tuple[str, float], ...]:
    """``["sharegpt=0.9", "arxiv=0.1"]`` -> ((name, weight), ...); weight defaults to 1."""
    parsed = []
    for item in items:
        name, _, weight = item.partition("=")
        parsed.append((name, float(weight) if weight else 1.0))
    return tuple(parsed)
