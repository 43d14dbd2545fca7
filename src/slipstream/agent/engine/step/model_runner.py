"""The model runner: the only place that owns the model, the KV tensors and the device.

    Batch (from the scheduler) -> flat input tensors + AttentionMetadata
        -> model forward (attention backend reads/writes the paged KV cache)
        -> logits at each chunk that asks to sample -> Sampler -> {request_id: SampledToken}

It makes no policy decisions: it runs exactly the chunks it is given. Three paths:

- decodes only, on CUDA (``EngineConfig.cuda_graphs``, on by default there): one replay of
  the captured graph of the smallest size holding the batch (``decode_graphs.py``);
- any other step of up to 512 tokens, under the same switch: piecewise graphs, everything
  but attention replayed at the padded token count (``mixed_graphs.py``);
- with ``EngineConfig.short_prefill_graphs``, a batch made only of whole fresh short prompts
  that fits a (length, batch) bucket: the padded static path of ``short_prefill.py``;
- everything else: eager, here. Token ids, positions, the rows to sample and the attention
  metadata reach the device in one copy, the forward never waits for the GPU, and the sampler
  brings the tokens back in one copy.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection
from typing import TypeVar

import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.step.cpu_compile import (attend_eager_decodes_natively,
                                                      make_cpu_compiled_decodes)
from slipstream.agent.engine.step.cpu_heap import keep_step_buffers_mapped
from slipstream.agent.engine.step.decode_graphs import DecodeGraphs, graph_friendly, greedy_only
from slipstream.agent.engine.step.mixed_graphs import MixedGraphs
from slipstream.agent.engine.kv.memory import (
    KVCachePlan, allocate_kv_tensor, available_memory_bytes, plan_kv_cache)
from slipstream.agent.engine.kv.tier_settings import KVTierSettings
from slipstream.agent.engine.kv.tier_store import (
    DiskTier, KVTierStore, measure_disk_read_gb_per_s, measure_host_load_gb_per_s)
from slipstream.agent.engine.models.loader import load_model, resolve_dtype, weight_source
from slipstream.agent.engine.models.cpu_matmul import apply_cpu_matmul
from slipstream.agent.engine.models.llama import KVCache
from slipstream.agent.engine.sampling.sampler import NON_FINITE_ERROR, MaskSource, Sampler
from slipstream.agent.engine.step.short_prefill import ShortPrefillExecutor
from slipstream.agent.scheduler.batch import Batch, BlockCopy
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.kv_tiers import KVTierConfig, TierResults
from slipstream.kernels.attention import AttentionMetadata, select_backend
from slipstream.agent.engine.step.batch_io import FlatInputs, SampledToken, sample_batch

log = logging.getLogger(__name__)
Graphs = TypeVar("Graphs", DecodeGraphs, MixedGraphs)


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but CUDA is not available")
    return device


def plan_kv_blocks(config: EngineConfig, model_config: ModelConfig, device: torch.device,
                   dtype: torch.dtype, kv_heads_all_layers: int,
                   ranks_sharing_memory: int = 1) -> KVCachePlan:
    """The KV cache of one rank holding ``kv_heads_all_layers`` KV heads summed over its
    layers: ``config.num_kv_blocks`` when given, else sized from the free memory (call it
    after the weights are loaded), split evenly between ``ranks_sharing_memory`` ranks that
    draw on the same memory (CPU ranks of one machine). Logs what it chose; raises
    KVCacheSizeError."""
    bytes_per_block = 2 * kv_heads_all_layers * model_config.head_dim * BLOCK_SIZE * (
        torch.finfo(dtype).bits // 8)
    if config.num_kv_blocks is not None:
        return KVCachePlan(config.num_kv_blocks, bytes_per_block, None,
                           f"KV cache: {config.num_kv_blocks:,} blocks (--num-kv-blocks)")
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    requested = config.kv_cache_memory
    available = available_memory_bytes(device) // ranks_sharing_memory
    plan = plan_kv_cache(requested=requested, device_type=device.type,
                         available_bytes=available, bytes_per_block=bytes_per_block,
                         block_size=BLOCK_SIZE, max_model_len=max_model_len,
                         max_num_seqs=config.scheduler.max_num_seqs)
    log.info("%s", plan.reason)
    return plan


class ModelRunner:
    """The in-process ``Runner`` (``runner.py``): no pipeline, so ``submit`` runs the batch."""

    pipeline_depth = 1

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        torch.manual_seed(config.seed)
        self.model = load_model(config.model_dir, self.device, self.dtype, model_config,
                                load_format=config.load_format, weights=weight_source(config))
        self.cpu_matmul = apply_cpu_matmul(self.model, config.cpu_matmul, self.device, self.dtype)
        self.backend = select_backend(self.device, config.attention_backend)
        self.kv_plan = plan_kv_blocks(config, model_config, self.device, self.dtype,
                                      model_config.num_layers * model_config.num_kv_heads)
        self.num_kv_blocks = self.kv_plan.num_blocks
        # The padded short-prefill path needs one block the block manager never hands out,
        # for the KV writes of its padding: block ``num_kv_blocks``, past the managed range.
        scratch_blocks = 1 if config.short_prefill_graphs else 0
        self.kv_caches = self._allocate(self.num_kv_blocks + scratch_blocks, self.device)
        self.host_kv_caches = self._allocate(0, torch.device("cpu"))
        self.kv_tiers: KVTierStore | None = None  # enable_kv_tiers()
        self.sampler = Sampler(config.seed)
        # Seconds spent in the model forward (and logits) by the last execute(): the rest of
        # an engine step is scheduling, tensor preparation, sampling and output handling.
        self.last_forward_s = 0.0
        self.short_prefill = self._make_short_prefill() if config.short_prefill_graphs else None
        self.decode_graphs = self._make_decode_graphs()
        attend_eager_decodes_natively(self.decode_graphs, self.backend)
        self.mixed_graphs = self._make_mixed_graphs()
        self._next_seq = 0
        self._done: deque[tuple[int, dict[str, SampledToken]]] = deque()
        if self.device.type == "cpu":  # after loading: steps reuse their freed temporaries
            keep_step_buffers_mapped()
        log.info("model %s on %s (%s), %d KV blocks of %d tokens, attention backend %s",
                 config.model_name, self.device, self.dtype, self.num_kv_blocks, BLOCK_SIZE,
                 self.backend.name)

    def _make_short_prefill(self) -> ShortPrefillExecutor:
        executor = ShortPrefillExecutor(self.model, self.kv_caches,
                                        self.config.short_prefill_buckets,
                                        scratch_block=self.num_kv_blocks, device=self.device)
        if self.device.type == "cuda":
            executor.capture()
        else:
            log.info("cuda_graphs on a %s device: the padded short-prefill path runs eagerly "
                     "(no graph capture)", self.device.type)
        return executor

    def _make_decode_graphs(self) -> DecodeGraphs | None:
        """Decode graphs on CUDA unless turned off; they run our Triton decode kernel, so a
        FlashInfer or torch attention backend keeps decodes eager. On a CPU, the same static
        programs compiled by inductor where ``cpu_compile`` resolves on."""
        if self.device.type == "cpu" and self.config.cpu_compile is not False \
                and not self.config.cuda_graphs:  # True on a CPU: the eager Triton path, tests
            return make_cpu_compiled_decodes(self.config, self.model_config, self.backend.name,
                                             self.cpu_matmul, self.model, self.kv_caches,
                                             self.device)
        if self.config.cpu_compile:
            raise ValueError(f"--cpu-compile compiles decode steps on a CPU; this engine runs "
                             f"on {self.device.type}, where decodes replay CUDA graphs")
        wanted = self.config.cuda_graphs
        if wanted is False or (wanted is None and self.device.type != "cuda"):
            return None
        if self.model_config.moe is not None:
            # The grouped expert computation sizes its matmuls from the routing (a host sync
            # per sparse layer), which a graph cannot replay.
            log.info("decode CUDA graphs do not capture mixture-of-experts layers yet; "
                     "decodes stay eager")
            return None
        if self.backend.name != "triton":
            log.info("decode CUDA graphs run the Triton attention kernels; with the %s backend "
                     "decodes stay eager", self.backend.name)
            return None
        graphs = DecodeGraphs(
            self.model, self.kv_caches, self.config.scheduler.max_num_seqs,
            self.config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.num_kv_heads, self.device)
        return self._captured(graphs, "decode", "decodes run eagerly")

    def _make_mixed_graphs(self) -> MixedGraphs | None:
        """Piecewise graphs for the other steps of up to 512 tokens, under the decode
        graphs' switch: on by default on CUDA, eager pieces on a CPU when asked for."""
        wanted = self.config.cuda_graphs
        if wanted is False or (wanted is None and self.device.type != "cuda"):
            return None
        if self.model_config.moe is not None:
            return None  # logged with the decode graphs
        graphs = MixedGraphs(self.model, self.kv_caches, self.device, self.dtype)
        return self._captured(graphs, "piecewise", "mixed steps run eagerly")

    def _captured(self, graphs: Graphs, kind: str, otherwise: str) -> Graphs | None:
        """``graphs`` captured on CUDA (as they are on a CPU); None where capture fails and
        graphs were not asked for explicitly (a driver or allocator refusing it)."""
        if self.device.type == "cuda":
            try:
                graphs.capture()
            except RuntimeError as error:
                if self.config.cuda_graphs:
                    raise
                log.warning("%s CUDA graph capture failed (%s); %s (--no-cuda-graphs "
                            "silences this)", kind, error, otherwise)
                torch.cuda.synchronize(self.device)
                return None
        return graphs

    def allocate_host_cache(self, num_blocks: int) -> None:
        """Host-memory KV blocks that swap preemption copies device blocks into."""
        self.host_kv_caches = self._allocate(num_blocks, torch.device("cpu"))

    def enable_kv_tiers(self, settings: KVTierSettings, host_load_gb_per_s: float = 0.0,
                        disk_read_gb_per_s: float = 0.0) -> KVTierConfig | None:
        """Allocate the host tier (and open the disk tier) under this runner's KV pool;
        returns what the scheduler's index needs (blocks, bytes, bandwidths: the profile's
        when given, else measured now), or None when the host memory cannot be had (logged:
        the engine serves without tiers rather than not at all)."""
        layer_shape = tuple(self.kv_caches[0][0].shape)
        num_layers = len(self.kv_caches)
        bytes_per_block = 2 * num_layers * BLOCK_SIZE * layer_shape[2] * layer_shape[3] * (
            torch.finfo(self.dtype).bits // 8)
        host_blocks = settings.host_memory_bytes // bytes_per_block
        if host_blocks < 1:
            raise ValueError(f"--kv-host-memory {settings.host_memory_bytes} bytes holds no "
                             f"KV block ({bytes_per_block} bytes each)")
        disk = None
        if settings.disk_path is not None:
            disk = DiskTier(settings.disk_path,
                            DiskTier.blocks_for(settings.disk_size_bytes, bytes_per_block),
                            bytes_per_block)
            if disk.num_blocks < 1:
                raise ValueError(f"--kv-disk-size {settings.disk_size_bytes} bytes holds no "
                                 f"KV block ({bytes_per_block} bytes each)")
        try:
            self.kv_tiers = KVTierStore(layer_shape, num_layers, self.dtype, self.device,
                                        host_blocks, disk)
        except RuntimeError as error:  # out of (pinnable) host memory
            log.warning("KV host tier of %d blocks could not be allocated (%s); serving "
                        "without KV tiers", host_blocks, error)
            return None
        host_gb_per_s = host_load_gb_per_s or measure_host_load_gb_per_s(self.device, self.dtype)
        disk_gb_per_s = disk_read_gb_per_s or (
            measure_disk_read_gb_per_s(disk.path) if disk is not None else 1.0)
        log.info("KV tiers: host %d blocks (%.2f GiB, %.1f GB/s to the device)%s", host_blocks,
                 host_blocks * bytes_per_block / 2**30, host_gb_per_s,
                 "" if disk is None else f", disk {disk.num_blocks} blocks in {disk.path} "
                 f"({disk_gb_per_s:.2f} GB/s read)")
        return KVTierConfig(host_blocks=host_blocks,
                            disk_blocks=disk.num_blocks if disk is not None else 0,
                            bytes_per_block=bytes_per_block, host_load_gb_per_s=host_gb_per_s,
                            disk_read_gb_per_s=disk_gb_per_s)

    def poll_kv_tiers(self) -> TierResults:
        return self.kv_tiers.poll() if self.kv_tiers is not None else TierResults()

    def kv_tier_counters(self) -> dict[str, float]:
        store = self.kv_tiers
        if store is None:
            return {}
        return {"kv_tier_bytes_offloaded": store.bytes_offloaded,
                "kv_tier_bytes_loaded": store.bytes_loaded,
                "kv_tier_bytes_spilled": store.bytes_spilled,
                "kv_tier_bytes_fetched": store.bytes_fetched,
                "kv_tier_load_seconds": store.load_seconds,
                "kv_tier_fetch_seconds": store.fetch_seconds}

    def _allocate(self, num_blocks: int, device: torch.device) -> list[KVCache]:
        shape = (num_blocks, BLOCK_SIZE, self.model_config.num_kv_heads, self.model_config.head_dim)
        return [(allocate_kv_tensor(shape, self.dtype, device),
                 allocate_kv_tensor(shape, self.dtype, device))
                for _ in range(self.model_config.num_layers)]

    # -- the Runner protocol ----------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        return len(self._done)

    def submit(self, batch: Batch, masks: MaskSource | None = None) -> int:
        seq = self._next_seq
        self._next_seq += 1
        self._done.append((seq, self.execute(batch, masks)))
        return seq

    def collect(self, block: bool) -> list[tuple[int, dict[str, SampledToken]]]:
        done = list(self._done)
        self._done.clear()
        return done

    def release(self, request_ids: Collection[str]) -> None:
        """Nothing to drop: this runner keeps no per-request state."""

    def check_alive(self) -> None:
        """In-process: alive as long as the engine is."""

    def close(self) -> None:
        """Stop the KV tiers' I/O thread, if any."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    @torch.inference_mode()
    def execute(self, batch: Batch, masks: MaskSource | None = None
                ) -> dict[str, SampledToken]:
        """Run the batch and sample; ``masks`` (grammar masks of the guided sampling rows)
        is called after the forward, so that they can be computed while it runs."""
        store, tier_ops = self.kv_tiers, batch.tier_ops
        for copy in batch.swap_out:
            self._copy_blocks(self.kv_caches, self.host_kv_caches, copy)
        if store is not None and tier_ops is not None:
            store.before_swap_in(tier_ops, self.kv_caches)
        for copy in batch.swap_in:
            self._copy_blocks(self.host_kv_caches, self.kv_caches, copy)
        if store is not None and tier_ops is not None:
            store.after_swap_in(tier_ops, self.kv_caches)
        if not batch.chunks:
            return {}
        graphs = self.decode_graphs
        if graphs is not None and len(batch.chunks) <= graphs.max_size \
                and graph_friendly(batch.chunks):
            return self._execute_from_graph(graphs, batch, masks)
        logits, sample_rows = self._forward_sampling(batch)
        return sample_batch(self.sampler, batch, sample_rows, logits, masks)

    def _execute_from_graph(self, graphs: DecodeGraphs, batch: Batch,
                            masks: MaskSource | None) -> dict[str, SampledToken]:
        """A decode-only batch from its graph: the graph's greedy tokens when every row is
        greedy (one copy back), else its logits through the sampler."""
        chunks = batch.chunks
        started = time.perf_counter()
        program = graphs.run(chunks)
        if masks is None and greedy_only(chunks):
            tokens, finite = graphs.greedy(program, len(chunks))
            self.last_forward_s = time.perf_counter() - started
            return {chunk.request_id: SampledToken(token, None,
                                                   None if ok else NON_FINITE_ERROR)
                    for chunk, token, ok in zip(chunks, tokens, finite)}
        logits = graphs.logits(program, len(chunks))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - started
        return sample_batch(self.sampler, batch, [(row, row) for row in range(len(chunks))],
                            logits, masks)

    @torch.inference_mode()
    def sample_logits(self, batch: Batch) -> torch.Tensor:
        """Logits ``[num_sampling_chunks, vocab]`` at the last token of each chunk that
        samples, computed on the path ``execute()`` would take (and writing the same KV)."""
        return self._forward_sampling(batch)[0]

    def _forward_sampling(self, batch: Batch):
        """The forward of one batch: logits of the chunks that sample, and their
        ``(chunk index, row)``. Times the forward alone into ``last_forward_s``."""
        short_prefill = self.short_prefill
        bucket = short_prefill.select(batch.chunks) if short_prefill is not None else None
        if short_prefill is not None and bucket is not None:
            chunks = list(batch.chunks)
            sample_rows = [(index, index) for index in range(len(chunks))]
            short_prefill.load_inputs(chunks, bucket)
            started = time.perf_counter()
            logits = short_prefill.forward(bucket, len(chunks))
        else:
            input_ids, positions, metadata, sample_rows, sample_index = self._prepare(batch)
            started = time.perf_counter()
            self.backend.plan(metadata)
            mixed = self.mixed_graphs
            if mixed is not None and mixed.size_for(input_ids.shape[0]) is not None:
                hidden = mixed.forward(input_ids, positions, self.backend)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, self.backend)
            logits = self.model.compute_logits(hidden.index_select(0, sample_index))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_forward_s = time.perf_counter() - started
        return logits, sample_rows

    @torch.inference_mode()
    def compute_logits(self, batch: Batch) -> torch.Tensor:
        """Logits ``[num_tokens, vocab]`` for every token of the batch (correctness checks and
        profiling; serving samples only the last token of each chunk)."""
        input_ids, positions, metadata, _, _ = self._prepare(batch)
        self.backend.plan(metadata)
        return self.model.compute_logits(
            self.model(input_ids, positions, self.kv_caches, self.backend))

    def _prepare(self, batch: Batch):
        """Token ids, positions, attention metadata, the sampled ``(chunk, row)`` pairs and
        those rows as a device index: every array built on the host, moved in one copy."""
        flat = FlatInputs.of(batch.chunks)
        slots: list[int] = []
        for chunk in batch.chunks:
            table = chunk.block_ids
            slots.extend(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
                         for pos in range(chunk.start_pos, chunk.end_pos))
        metadata, (input_ids, positions, sample_index) = AttentionMetadata.build_with(
            query_lens=[c.num_tokens for c in batch.chunks],
            kv_lens=[c.end_pos for c in batch.chunks],
            query_start_pos=[c.start_pos for c in batch.chunks],
            block_tables=[c.block_ids for c in batch.chunks],
            slot_mapping=slots, block_size=BLOCK_SIZE, device=self.device,
            extra=[flat.token_ids, flat.positions, [row for _, row in flat.sample_rows]])
        return input_ids, positions, metadata, flat.sample_rows, sample_index

    @staticmethod
    def _copy_blocks(source, destination, copy: BlockCopy) -> None:
        src = torch.tensor(copy.src_block_ids, dtype=torch.int64)
        dst = torch.tensor(copy.dst_block_ids, dtype=torch.int64)
        for (src_k, src_v), (dst_k, dst_v) in zip(source, destination):
            dst_k[dst.to(dst_k.device)] = src_k[src.to(src_k.device)].to(dst_k.device)
            dst_v[dst.to(dst_v.device)] = src_v[src.to(src_v.device)].to(dst_v.device)
