"""Turn a simulation into the numbers people compare: latency percentiles, goodput, throughput.

    SimResult --> summarize() --> one JSON-able dict per policy (slipstream simulate's output)

Definitions follow vLLM's ``bench serve`` where they overlap, so simulated and measured
numbers read the same way:
- TTFT: first token time - arrival. TPOT: ``(e2e - ttft) / (output_tokens - 1)`` for requests
  with more than one output token. E2E: finish - arrival.
- A request meets its SLOs when its TTFT is within its deadline (the scheduler's: from the
  request's SLO, else ``max(1.5 * T(p), 0.5 s)``) and, if a TPOT SLO is given, its TPOT is
  within it. Goodput is such requests per second of the run; throughput counts all finished.
- The run lasts from the first arrival to the last finish, or to the horizon if one was set.
- ``worst_long_delay_s``: the longest any long request waited for its first token, counting
  requests that never got one up to the end of the run.
"""

from __future__ import annotations

import numpy as np

from slipstream.sim.instance import RequestRecord
from slipstream.sim.simulator import SimResult
from slipstream.sim.traces import HASH_BLOCK_TOKENS

PERCENTILES = (50, 90, 99)


def distribution(values: list[float], scale: float = 1.0) -> dict:
    if not values:
        return {"count": 0}
    array = np.asarray(values, dtype=np.float64) * scale
    stats = {"count": int(array.size), "mean": float(array.mean())}
    for q, value in zip(PERCENTILES, np.percentile(array, PERCENTILES)):
        stats[f"p{q}"] = float(value)
    stats["max"] = float(array.max())
    return stats


def ttft_s(record: RequestRecord) -> float | None:
    return None if record.first_token_s is None else record.first_token_s - record.arrival_s


def tpot_s(record: RequestRecord) -> float | None:
    if record.finished_s is None or record.first_token_s is None or record.output_tokens < 2:
        return None
    return (record.finished_s - record.first_token_s) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, tpot_slo_ms: float | None) -> bool:
    ttft = ttft_s(record)
    if record.finished_s is None or ttft is None:
        return False
    if record.ttft_deadline_s is not None and ttft > record.ttft_deadline_s + 1e-9:
        return False
    tpot = tpot_s(record)
    return tpot_slo_ms is None or tpot is None or tpot * 1000.0 <= tpot_slo_ms


def class_metrics(records: list[RequestRecord], end_s: float, duration_s: float,
                  tpot_slo_ms: float | None) -> dict:
    finished = [r for r in records if r.finished_s is not None]
    ttfts = [t for r in records if (t := ttft_s(r)) is not None]
    tpots = [t for r in finished if (t := tpot_s(r)) is not None]
    good = sum(1 for r in finished if meets_slo(r, tpot_slo_ms))
    waits = [(end_s if r.first_token_s is None else r.first_token_s) - r.arrival_s
             for r in records]
    return {
        "requests": len(records),
        "completed": len(finished),
        "unfinished": len(records) - len(finished),
        "ttft_s": distribution(ttfts),
        "tpot_ms": distribution(tpots, 1000.0),
        "e2e_s": distribution([r.finished_s - r.arrival_s for r in records
                               if r.finished_s is not None]),
        "slo_attained": good,
        "slo_attainment": good / len(records) if records else None,
        "goodput_rps": good / duration_s if duration_s > 0 else 0.0,
        "worst_first_token_wait_s": max(waits) if waits else None,
        "preemptions": sum(r.num_preemptions for r in finished),
    }


def prefix_hit_bound_tokens(records: list[RequestRecord]) -> list[int]:
    """Per request (in arrival order), the prompt tokens an unbounded prefix cache shared by
    every instance would hold: the leading blocks of its hash ids that an earlier request
    had, at most all but its last token."""
    seen: set[tuple[int, ...]] = set()
    bounds = []
    for record in sorted(records, key=lambda r: r.arrival_s):
        prefix: tuple[int, ...] = ()
        hit_blocks, hitting = 0, True
        for hash_id in record.hash_ids:
            prefix += (hash_id,)
            if hitting and prefix in seen:
                hit_blocks += 1
            else:
                hitting = False
                seen.add(prefix)
        bounds.append(min(hit_blocks * HASH_BLOCK_TOKENS, max(0, record.prompt_tokens - 1)))
    return bounds


def prefix_cache_summary(records: list[RequestRecord]) -> dict:
    """Prompt tokens found cached at first admission, against the unbounded-cache bound."""
    admitted = [r for r in records if r.first_token_s is not None]
    prompt = sum(r.prompt_tokens for r in admitted)
    hits = sum(r.cached_tokens for r in admitted)
    bound_by_id = dict(zip((r.request_id for r in sorted(records, key=lambda r: r.arrival_s)),
                           prefix_hit_bound_tokens(records)))
    bound = sum(bound_by_id[r.request_id] for r in admitted)
    return {"prompt_tokens": prompt, "hit_tokens": hits, "bound_tokens": bound,
            "hit_rate": hits / prompt if prompt else 0.0,
            "bound_hit_rate": bound / prompt if prompt else 0.0,
            "fraction_of_bound": hits / bound if bound else 0.0}


def summarize(result: SimResult, long_prompt_tokens: int, tpot_slo_ms: float | None) -> dict:
    records = result.records
    if records:
        finishes = [r.finished_s for r in records if r.finished_s is not None]
        last = result.horizon_s if result.horizon_s is not None else max(finishes, default=0.0)
        duration_s = max(last - records[0].arrival_s, 1e-9)
    else:
        duration_s = 1e-9
    end_s = result.horizon_s if result.horizon_s is not None else result.end_s
    short = [r for r in records if r.prompt_tokens < long_prompt_tokens]
    long = [r for r in records if r.prompt_tokens >= long_prompt_tokens]
    overall = class_metrics(records, end_s, duration_s, tpot_slo_ms)
    completed = [r for r in records if r.finished_s is not None]
    long_metrics = class_metrics(long, end_s, duration_s, tpot_slo_ms)
    return {
        "policy": result.policy,
        "duration_s": duration_s,
        "requests": len(records),
        "completed": overall["completed"],
        "unfinished": overall["unfinished"],
        "throughput_rps": len(completed) / duration_s,
        "output_throughput_tps": sum(r.output_tokens for r in completed) / duration_s,
        "goodput_rps": overall["goodput_rps"],
        "worst_long_delay_s": long_metrics["worst_first_token_wait_s"],
        "overall": overall,
        "short": class_metrics(short, end_s, duration_s, tpot_slo_ms),
        "long": long_metrics,
        "long_prompt_tokens": long_prompt_tokens,
        "tpot_slo_ms": tpot_slo_ms,
        "prefix_cache": {**prefix_cache_summary(records),
                         "hit_tokens_by_tier": result.tier_hit_tokens},
        "sim": {"iterations": result.num_iterations, "wall_s": result.wall_s,
                "simulated_s": result.end_s, "busy_fraction": [
                    b / max(result.end_s, 1e-9) for b in result.busy_s]},
    }


def short_ttft_series(result: SimResult, long_prompt_tokens: int) -> tuple[list[float], list[float]]:
    """(arrival time, TTFT) of short requests that got a first token, for the time plot."""
    points = [(r.arrival_s, ttft) for r in result.records
              if r.prompt_tokens < long_prompt_tokens and (ttft := ttft_s(r)) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def ttft_values(result: SimResult, which: str, long_prompt_tokens: int) -> list[float]:
    records = result.records
    if which == "short":
        records = [r for r in records if r.prompt_tokens < long_prompt_tokens]
    elif which == "long":
        records = [r for r in records if r.prompt_tokens >= long_prompt_tokens]
    return [t for r in records if (t := ttft_s(r)) is not None]
