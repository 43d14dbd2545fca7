"""One simulated serving instance: the real Scheduler, timed by the runtime predictor.

    router --add()--> SimInstance.step(now) --> Scheduler.schedule() --> Batch
        the batch "runs" for the predictor's time (Batch.predicted_time_s, already computed by
        the packer), then Scheduler.update() with placeholder tokens --> RequestRecord times

Parallel degrees of an instance (``tp x spp x kvp`` GPUs):

- TP is baked into the profile tables (the H100 tables are measured at TP 8); an instance's
  TP must equal the profile's.
- SPP: each of ``spp`` stages runs ``num_layers / spp`` layers, so a batch spends ``t / spp``
  (plus an activation hand-off) in each stage. As in Medha, the next batch enters stage 1 as
  soon as the previous one leaves it: a prefill's next chunk only needs the KV of the previous
  chunk, not its output. A request whose batch samples a token (a decode, a last prefill
  chunk) must wait for that token, which comes out after all ``spp`` stages; until then it is
  parked, hidden from the scheduler. So decodes keep their full-model latency while one long
  prefill streams through the pipeline ``spp`` times faster. With ``spp = 1`` this is the plain
  loop: schedule, run for ``t``, update.
- KVP: a request's KV is split along the sequence over groups of ``kvp_tokens_per_group``
  tokens. Each group attends over its shard in parallel, so attention costs what the largest
  shard costs, plus merging the partial outputs (one exchange of ``heads x head_dim`` values
  per query token and layer). The scheduler sees this cost model too (``KvpTimeModel``),
  exactly as a live engine with KVP would predict its batches.

With AWD short-prefill batching a step can find nothing to run while short prompts are held.
The instance then sleeps until the scheduler's wakeup (``Scheduler.next_wakeup_s``), and
``waiting_for_wakeup`` tells the event loop that an arrival may end that sleep early, as a new
request wakes the live engine thread.

KV tiers (``InstanceConfig.kv_host_blocks``/``kv_disk_blocks``): the scheduler's own tier index
runs as it does live. A load from host memory is already in the batch's predicted time (the
packer prices it at ``host_load_gb_per_s``). A fetch from disk completes ``bytes /
disk_read_gb_per_s`` after it starts, one at a time in order, as the live store's single I/O
thread runs them; the scheduler hears of it at the instance's first step after that. Offloads
to the host and spills to disk run beside the compute (a GPU's copy engines, an I/O thread) and
cost no step time here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slipstream.contracts.request import EngineRequest, RequestSLO
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, TierResults
from slipstream.agent.scheduler.predictor import BatchTimeModel
from slipstream.agent.scheduler.request import FinishReason, Request
from slipstream.agent.scheduler.scheduler import Scheduler
from slipstream.sim.traces import HASH_BLOCK_TOKENS, TraceRequest

BYTES_PER_VALUE = 2  # bf16 activations
STALLED_RETRY_S = 1e-3  # nothing ran and no wakeup is known: look again after this long
MIN_WAKEUP_DELAY_S = 1e-6  # a wakeup never lands on the same instant (no zero-time loops)


@dataclass(frozen=True)
class InstanceConfig:
    tp: int = 1
    spp: int = 1
    kvp: int = 1
    kvp_tokens_per_group: int | None = None  # required when kvp > 1
    num_kv_blocks: int | None = None  # None: estimated from GPU memory (see kv_capacity.py)
    hidden_size: int = 4096  # activation width for SPP hand-offs and KVP merges
    link_gb_per_s: float = 25.0  # stage-to-stage and KVP group links (InfiniBand 200 Gb/s)
    link_latency_ms: float = 0.01
    # Host-side time per iteration that the profile does not include (the live engine's
    # scheduling and output processing); 0 for the GPU tables.
    host_overhead_ms: float = 0.0
    # KV tiers under the device pool (0: none), the bytes of one block over the whole
    # instance, and the instance's bandwidths (all its GPUs' PCIe links; its disks).
    kv_host_blocks: int = 0
    kv_disk_blocks: int = 0
    kv_bytes_per_block: int = 0
    host_load_gb_per_s: float = 25.0
    disk_read_gb_per_s: float = 12.0
    # Share of the host tier kept for reused blocks (None: KVTierConfig's default).
    kv_host_protected_fraction: float | None = None

    def __post_init__(self) -> None:
        if min(self.tp, self.spp, self.kvp) < 1:
            raise ValueError("tp, spp and kvp must be >= 1")
        if self.kvp > 1 and not self.kvp_tokens_per_group:
            raise ValueError("kvp > 1 needs kvp_tokens_per_group")
        if self.link_gb_per_s <= 0 or self.link_latency_ms < 0 or self.host_overhead_ms < 0:
            raise ValueError("link bandwidth must be > 0, latencies >= 0")
        self.tier_config()  # validates the tier fields

    def tier_config(self) -> KVTierConfig | None:
        if not self.kv_host_blocks:
            return None
        config = KVTierConfig(host_blocks=self.kv_host_blocks, disk_blocks=self.kv_disk_blocks,
                              bytes_per_block=self.kv_bytes_per_block,
                              host_load_gb_per_s=self.host_load_gb_per_s,
                              disk_read_gb_per_s=self.disk_read_gb_per_s)
        if self.kv_host_protected_fraction is None:
            return config
        return replace(config, host_protected_fraction=self.kv_host_protected_fraction)

    def transfer_ms(self, num_tokens: int) -> float:
        """One hand-off of ``num_tokens`` activations between two GPU groups. Each of the
        ``tp`` ranks sends its own slice of the hidden dimension over its own link."""
        megabytes = num_tokens * self.hidden_size / self.tp * BYTES_PER_VALUE / 1e6
        return self.link_latency_ms + megabytes / self.link_gb_per_s


class KvpTimeModel:
    """Wraps a batch-time model with KV-parallel attention (see the module docstring)."""

    def __init__(self, base: BatchTimeModel, config: InstanceConfig, num_layers: int) -> None:
        self.base = base
        self.config = config
        if config.kvp_tokens_per_group is None:
            raise ValueError("KV-parallel timing needs kvp_tokens_per_group")
        self.group_tokens = config.kvp_tokens_per_group
        self.num_layers = num_layers
        self.iteration_overhead_ms = base.iteration_overhead_ms

    def linear_ms(self, num_tokens: int) -> float:
        return self.base.linear_ms(num_tokens)

    def _merge_ms(self, query_tokens: int, groups: int) -> float:
        if groups <= 1:
            return 0.0
        return self.num_layers * self.config.transfer_ms(query_tokens * (groups - 1))

    def prefill_attention_ms(self, kv_before_tokens: int, chunk_tokens: int) -> float:
        groups = min(self.config.kvp, kv_before_tokens // self.group_tokens + 1)
        # The owning group holds the newest shard plus the chunk; full groups hold group_tokens.
        largest_shard = min(kv_before_tokens, self.group_tokens)
        return (self.base.prefill_attention_ms(largest_shard, chunk_tokens)
                + self._merge_ms(chunk_tokens, groups))

    def decode_attention_ms(self, batch_size: int, kv_total_tokens: int) -> float:
        # Requests start on different groups, so a decode batch's KV reads spread over all
        # groups; a request longer than one group also pays a merge.
        kvp = self.config.kvp
        per_group = -(-batch_size // kvp)
        ms = self.base.decode_attention_ms(per_group, -(-kv_total_tokens // kvp))
        if batch_size and kv_total_tokens // batch_size > self.group_tokens:
            ms += self._merge_ms(batch_size, kvp)
        return ms


class RequestRecord:
    """What the report needs about one request, on the simulated clock."""

    __slots__ = ("request_id", "arrival_s", "prompt_tokens", "output_tokens", "source",
                 "instance", "ttft_deadline_s", "first_token_s", "finished_s",
                 "num_preemptions", "hash_ids", "cached_tokens", "serial")

    def __init__(self, request_id: str, arrival_s: float, prompt_tokens: int,
                 output_tokens: int, source: str, hash_ids: tuple[int, ...] = (),
                 serial: int = 0) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.source = source
        self.instance = -1
        self.ttft_deadline_s: float | None = None
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self.num_preemptions = 0
        self.hash_ids = hash_ids
        self.serial = serial  # unique per run: seeds the tokens no other prompt shares
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at admission

    def prompt_token_ids(self) -> list[int]:
        """Stand-in token ids with the trace's sharing: block ``j`` of a hash id ``h`` is
        ``HASH_BLOCK_TOKENS`` copies of ``h``, so equal hash ids give equal tokens (the block
        manager's hash chain adds the position); the rest is unique to this request."""
        tokens: list[int] = []
        for hash_id in self.hash_ids:
            if len(tokens) >= self.prompt_tokens:
                break
            tokens.extend([hash_id] * HASH_BLOCK_TOKENS)
        del tokens[self.prompt_tokens:]
        tokens.extend([-1 - self.serial] * (self.prompt_tokens - len(tokens)))
        return tokens


def records_from(requests: list[TraceRequest]) -> list[RequestRecord]:
    """One record per trace request, in arrival order, ids ``r0, r1, ...``. Each carries the
    trace's hash ids and its own serial, so prompts share stand-in tokens only where their
    hash ids are equal (one serial for all would make the prefix cache find every prompt)."""
    return [RequestRecord(f"r{i}", r.arrival_s, r.prompt_tokens, r.output_tokens, r.source,
                          r.hash_ids, serial=i)
            for i, r in enumerate(sorted(requests, key=lambda r: r.arrival_s))]


class SimInstance:
    def __init__(self, index: int, scheduler: Scheduler, config: InstanceConfig,
                 records: dict[str, RequestRecord], tpot_slo_s: float | None = None) -> None:
        self.index = index
        self.tpot_slo_s = tpot_slo_s  # fed to the load window's TPOT attainment when set
        self.scheduler = scheduler
        self.config = config
        self.records = records
        self.backlog_tokens = 0  # routed tokens not yet processed (for the router)
        self.num_iterations = 0
        self.num_finished = 0
        self.busy_s = 0.0
        self._pending: tuple[Batch, float] | None = None  # (batch, exit_s) in the pipeline
        self._parked: dict[str, float] = {}  # request id -> when its sampled token comes out
        self.waiting_for_wakeup = False  # idle until AWD's wakeup; an arrival may come first
        # The live engine's load window, fed the same way: the pool rebalancer reads it.
        self.load = LoadWindow(start_s=0.0)
        # Disk fetches in flight, one entry per batch that started some: (when its last block
        # lands, their block hashes), in order; the disk is free again at _disk_free_s.
        self._fetches: list[tuple[float, list[bytes]]] = []
        self._disk_free_s = 0.0

    def add(self, record: RequestRecord, ttft_slo_s: float | None) -> None:
        request = Request(EngineRequest(
            record.request_id, record.prompt_token_ids(),
            SamplingParams(max_tokens=record.output_tokens), slo=RequestSLO(ttft_s=ttft_slo_s)),
            record.arrival_s)
        self.scheduler.add(request)
        self.load.record_arrival(record.arrival_s, record.prompt_tokens)
        record.instance = self.index
        assert request.ttft_deadline_s is not None, "the scheduler sets it on add()"
        record.ttft_deadline_s = request.ttft_deadline_s - record.arrival_s
        # The cached part of the prompt is never computed, so it is no backlog.
        self.backlog_tokens += (record.prompt_tokens - request.prefix_hit_tokens
                                + record.output_tokens)

    @property
    def idle(self) -> bool:
        return self._pending is None and not self.scheduler.has_unfinished()

    def step(self, now_s: float) -> float | None:
        """Finish the batch in flight, issue the next one; returns when to step again."""
        scheduler = self.scheduler
        if self._pending is not None:
            self._complete(now_s)
        if self._fetches:
            self._land_fetches(now_s)
        parked = self._parked
        if parked:
            for request_id in [rid for rid, until in parked.items() if until <= now_s]:
                del parked[request_id]
        if parked:
            running = scheduler.running
            hidden = [r for r in running if r.request_id in parked]
            scheduler.running = [r for r in running if r.request_id not in parked]
            batch = scheduler.schedule(now_s)
            scheduler.running.extend(hidden)
        else:
            batch = scheduler.schedule(now_s)
        self.waiting_for_wakeup = False
        if batch.tier_ops is not None and batch.tier_ops.fetch:
            self._start_fetches(now_s, [copy.block_hash for copy in batch.tier_ops.fetch])
        if not batch.chunks:
            return self._next_wake_s(now_s)
        self.num_iterations += 1
        config = self.config
        assert batch.predicted_time_s is not None, "schedule() predicts every batch it makes"
        time_s = batch.predicted_time_s + config.host_overhead_ms / 1000.0
        self.backlog_tokens = max(0, self.backlog_tokens - batch.num_tokens)
        prefill_tokens = batch.num_tokens - batch.num_decodes
        if config.spp == 1:
            self._pending = (batch, now_s + time_s)
            self.busy_s += time_s
            self.load.record_step(now_s, now_s + time_s, prefill_tokens)
            return now_s + time_s
        hop_s = config.transfer_ms(batch.num_tokens) / 1000.0
        stage_s = time_s / config.spp + hop_s
        self._pending = (batch, now_s + config.spp * stage_s - hop_s)
        self.busy_s += stage_s  # how long stage 1 is occupied
        self.load.record_step(now_s, now_s + stage_s, prefill_tokens)
        return now_s + stage_s

    def _start_fetches(self, now_s: float, hashes: list[bytes]) -> None:
        tiers = self.scheduler.block_manager.tiers
        assert tiers is not None
        done_s = max(now_s, self._disk_free_s) + tiers.config.fetch_s(len(hashes))
        self._fetches.append((done_s, hashes))
        self._disk_free_s = done_s

    def _land_fetches(self, now_s: float) -> None:
        landed = [block_hash for done_s, hashes in self._fetches if done_s <= now_s
                  for block_hash in hashes]
        if landed:
            self._fetches = [item for item in self._fetches if item[0] > now_s]
            self.scheduler.apply_tier_results(TierResults(fetched=tuple(landed)), now_s)

    def _next_wake_s(self, now_s: float) -> float | None:
        """After a step that ran nothing: a parked token coming out, AWD's wakeup, or a
        fetch from disk landing."""
        wakeups = list(self._parked.values())
        if self._fetches:
            wakeups.append(max(self._fetches[0][0], now_s + MIN_WAKEUP_DELAY_S))
        held_until_s = self.scheduler.next_wakeup_s(now_s)
        if held_until_s is not None:
            self.waiting_for_wakeup = True
            wakeups.append(max(held_until_s, now_s + MIN_WAKEUP_DELAY_S))
        if wakeups:
            return min(wakeups)
        return now_s + STALLED_RETRY_S if self.scheduler.has_unfinished() else None

    def backlog_prompt_tokens(self) -> int:
        """Prompt tokens still to prefill, counted as the live engine's stats() counts them
        (a waiting request's cached prefix is not work)."""
        return sum(r.num_uncached_tokens for r in self.scheduler.requests.values()
                   if r.in_prefill)

    def router_backlog_tokens(self, decode_weight_tokens: float,
                              ahead_of: int | None = None) -> float:
        """The live router's load estimate (router/instances.py): prefill tokens still to
        compute, plus each decoding request at ``decode_weight_tokens``. With ``ahead_of`` (a
        new request's uncached prompt tokens), each prefill counts only up to that many, as
        the router counts them for shorter-first instances."""
        prefill, decodes = 0, 0
        for request in self.scheduler.requests.values():
            if request.in_prefill:
                tokens = request.num_uncached_tokens
                prefill += tokens if ahead_of is None else min(tokens, ahead_of)
            else:
                decodes += 1
        return prefill + decodes * decode_weight_tokens

    def _complete(self, now_s: float) -> None:
        assert self._pending is not None
        batch, exit_s = self._pending
        self._pending = None
        scheduler = self.scheduler
        sampled = {chunk.request_id: 0 for chunk in batch.chunks if chunk.sample}
        scheduler.update(batch, sampled, now_s)
        requests, records = scheduler.requests, self.records
        park = self.config.spp > 1 and exit_s > now_s
        for request_id in sampled:
            request = requests.get(request_id)
            if request is None:
                continue
            record = records[request_id]
            if record.first_token_s is None:
                record.first_token_s = exit_s
                record.cached_tokens = request.num_cached_tokens
                # Every simulated request has a deadline (explicit or the scheduler's
                # default), so all first tokens feed the SLO deviation signal.
                if record.ttft_deadline_s:
                    self.load.record_first_token(exit_s, exit_s - record.arrival_s,
                                                 record.ttft_deadline_s)
            if request.num_output_tokens >= request.max_tokens:
                record.finished_s = exit_s
                first_token_s = record.first_token_s
                if self.tpot_slo_s is not None and record.output_tokens > 1:
                    self.load.record_finish(
                        exit_s, (exit_s - first_token_s) / (record.output_tokens - 1),
                        self.tpot_slo_s)
                record.num_preemptions = request.num_preemptions
                self.num_finished += 1
                scheduler.finish(request_id, FinishReason.LENGTH, now_s)
            elif park:
                self._parked[request_id] = exit_s
