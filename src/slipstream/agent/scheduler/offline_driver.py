"""Drive a Scheduler on a fake clock, with a fake runner that checks the KV bookkeeping.

    arrivals --> drive() --> Scheduler.schedule() --> FakeKvRunner.execute() --> update/finish
                  clock += the batch's predicted time

For unit tests, benchmarks and quick what-ifs; the discrete-event simulator (``sim``)
is the full version. The fake runner keeps a "KV cache" of device and host blocks holding
``(request_id, position, token)`` per slot: a canary of what the real KV would hold. It
applies swap copies, writes each chunk's tokens into its block table, and before sampling
checks that every earlier position of the sequence holds that position's token, so a lost
block, a wrong table, a bad swap or a cached prefix block that was evicted or overwritten
while in use fails loudly. Writing into a block that another request also holds (a shared
prefix block) fails too. KV tier copies (``Batch.tier_ops``) move canaries between the device
and a host and a disk dictionary in the store's order; a fetch is reported at the next
``poll``, failed for the hashes in ``corrupt_hashes`` (a corrupt disk block is never served).
The token it samples depends only on (request id, position), so a
request's output is the same however often it is preempted and whatever it found cached.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable

from slipstream.contracts.request import EngineRequest, RequestSLO
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.kv_tiers import TierCopy, TierResults
from slipstream.agent.scheduler.request import FinishReason, Request
from slipstream.agent.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class Arrival:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int  # the request finishes (LENGTH) after this many tokens
    app_id: str = "default"
    ttft_s: float | None = None
    prompt: tuple[int, ...] | None = None  # explicit prompt token ids (shared prefixes)
    share_prompt_with: str | None = None  # another choice of an n > 1 request (Request)


@dataclass
class DriveResult:
    finished: dict[str, Request] = field(default_factory=dict)
    end_s: float = 0.0
    num_steps: int = 0


def sampled_token(request_id: str, position: int, vocab_size: int = 32_000) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


class KvCorruption(AssertionError):
    pass


class FakeKvRunner:
    """Executes batches against a dictionary KV cache, checking what the scheduler granted."""

    def __init__(self, block_size: int, check_kv: bool = True,
                 sequences: Callable[[str, int], list[int]] | None = None,
                 ref_counts: list[int] | None = None) -> None:
        self.block_size = block_size
        self.check_kv = check_kv
        # Expected tokens [0, end) of a request, and the device blocks' reference counts.
        self.sequences = sequences
        self.ref_counts = ref_counts
        self.device: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.host: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.tier_host: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.tier_disk: dict[tuple[int, int], tuple[str, int, int]] = {}
        self.corrupt_hashes: set[bytes] = set()
        self._fetched: list[bytes] = []
        self._fetch_failed: list[bytes] = []

    def poll(self) -> TierResults:
        """The fetches of the batches executed so far, as the tier store reports them."""
        results = TierResults(fetched=tuple(self._fetched), fetch_failed=tuple(self._fetch_failed))
        self._fetched, self._fetch_failed = [], []
        return results

    def _tier_copies(self, copies: list[TierCopy], src: dict, dst: dict) -> None:
        for copy in copies:
            self._copy(src, dst, (copy.src,), (copy.dst,))

    def execute(self, batch: Batch) -> dict[str, int]:
        if not self.check_kv:
            if batch.tier_ops is not None:
                self._fetched.extend(c.block_hash for c in batch.tier_ops.fetch)
            return {chunk.request_id: sampled_token(chunk.request_id, chunk.end_pos)
                    for chunk in batch.chunks if chunk.sample}
        ops = batch.tier_ops
        for copy in batch.swap_out:
            self._copy(self.device, self.host, copy.src_block_ids, copy.dst_block_ids)
        if ops is not None:
            self._tier_copies(ops.spill, self.tier_host, self.tier_disk)
            self._tier_copies(ops.offload, self.device, self.tier_host)
        for copy in batch.swap_in:
            self._copy(self.host, self.device, copy.src_block_ids, copy.dst_block_ids)
        if ops is not None:
            self._tier_copies(ops.load, self.tier_host, self.device)
            for fetch in ops.fetch:
                if fetch.block_hash in self.corrupt_hashes:
                    self._fetch_failed.append(fetch.block_hash)
                else:
                    self._copy(self.tier_disk, self.tier_host, (fetch.src,), (fetch.dst,))
                    self._fetched.append(fetch.block_hash)
        sampled: dict[str, int] = {}
        refs = self.ref_counts
        for chunk in batch.chunks:
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.start_pos + offset
                block = chunk.block_ids[position // self.block_size]
                if refs is not None and refs[block] > 1:
                    raise KvCorruption(f"{chunk.request_id} writes position {position} into "
                                       f"block {block}, which {refs[block]} requests hold")
                self.device[(block, position % self.block_size)] = (chunk.request_id, position, token)
            if chunk.sample and self.check_kv:
                self._check_prefix(chunk.request_id, chunk.end_pos, chunk.block_ids)
                sampled[chunk.request_id] = sampled_token(chunk.request_id, chunk.end_pos)
        return sampled

    def _copy(self, src: dict, dst: dict, src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...]) -> None:
        for src_block, dst_block in zip(src_blocks, dst_blocks, strict=True):
            for slot in range(self.block_size):
                value = src.get((src_block, slot))
                if value is None:
                    dst.pop((dst_block, slot), None)
                else:
                    dst[(dst_block, slot)] = value

    def _check_prefix(self, request_id: str, end_pos: int, block_ids: tuple[int, ...]) -> None:
        expected = self.sequences(request_id, end_pos) if self.sequences is not None else None
        for position in range(end_pos):
            block = block_ids[position // self.block_size]
            value = self.device.get((block, position % self.block_size))
            if value is None or value[1] != position or (
                    value[0] != request_id if expected is None else value[2] != expected[position]):
                raise KvCorruption(f"{request_id}: KV at position {position} is {value}")


def make_request(arrival: Arrival) -> Request:
    if arrival.prompt is not None:
        prompt = list(arrival.prompt)
    else:
        prompt = [sampled_token(arrival.request_id, -1 - i) for i in range(arrival.prompt_tokens)]
    return Request(EngineRequest(
        arrival.request_id, prompt, SamplingParams(max_tokens=arrival.output_tokens),
        app_id=arrival.app_id, slo=RequestSLO(ttft_s=arrival.ttft_s),
        share_prompt_with=arrival.share_prompt_with), arrival.arrival_s)


def drive(scheduler: Scheduler, arrivals: list[Arrival], max_steps: int = 1_000_000,
          idle_step_s: float = 1e-3, until_s: float | None = None, check_kv: bool = True,
          on_batch: Callable[[Batch, float], None] | None = None) -> DriveResult:
    """Run until every request finished (or ``until_s``); the clock follows predicted times."""
    pending = sorted(arrivals, key=lambda a: a.arrival_s)[::-1]  # pop() takes the earliest
    requests = scheduler.requests
    runner = FakeKvRunner(scheduler.block_manager.block_size, check_kv,
                          sequences=lambda rid, end: requests[rid].token_ids(0, end),
                          ref_counts=scheduler.block_manager.device.ref_counts)
    result = DriveResult()
    now_s = 0.0
    while pending or scheduler.has_unfinished():
        if until_s is not None and now_s >= until_s:
            break
        while pending and pending[-1].arrival_s <= now_s:
            scheduler.add(make_request(pending.pop()))
        if not scheduler.has_unfinished():
            now_s = pending[-1].arrival_s
            continue
        scheduler.apply_tier_results(runner.poll(), now_s)
        batch = scheduler.schedule(now_s)
        if on_batch is not None:
            on_batch(batch, now_s)
        sampled = runner.execute(batch)
        now_s = _next_time(scheduler, batch, now_s, pending, idle_step_s)
        scheduler.update(batch, sampled, now_s)
        for request_id in sampled:
            request = scheduler.requests[request_id]
            if request.num_output_tokens >= request.max_tokens:
                finished = scheduler.finish(request_id, FinishReason.LENGTH, now_s)
                if finished is not None:
                    result.finished[request_id] = finished
        result.num_steps += 1
        if result.num_steps >= max_steps:
            raise RuntimeError(f"not done after {max_steps} steps")
    result.end_s = now_s
    return result


def _next_time(scheduler: Scheduler, batch: Batch, now_s: float, pending: list[Arrival],
               idle_step_s: float) -> float:
    """After a batch, its predicted end; after an empty step, the scheduler's wakeup (AWD
    holding short prefills) or the next arrival, whichever is first, else a short idle step."""
    if batch.chunks:
        assert batch.predicted_time_s is not None, "schedule() predicts every batch it makes"
        return now_s + batch.predicted_time_s
    wakeup_s = scheduler.next_wakeup_s(now_s)
    if wakeup_s is None:
        return now_s + idle_step_s
    if pending:
        wakeup_s = min(wakeup_s, pending[-1].arrival_s)
    return max(wakeup_s, now_s)
