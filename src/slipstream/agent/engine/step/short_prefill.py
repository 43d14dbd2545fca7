"""The bucketed short-prefill path: fresh short prompts padded to a (length, batch) bucket and
run with static shapes, one CUDA graph per bucket on CUDA (PLA-Serve, short pool).

    ModelRunner.execute(batch)
      -> select(): prefill_buckets picks the smallest bucket holding every prompt, or None
      -> load_inputs(): token ids, positions, slots and last-token rows built on the host in
                        one staging tensor -> one copy into the persistent device buffer
      -> forward(): CUDA: graph.replay()   elsewhere: the same forward, eagerly
      -> logits [num_prompts, vocab] of each prompt's last real token -> Sampler

Every bucket's inputs are fixed-address views of one int64 device buffer::

    [ token ids (T) | positions (T) | KV slots (T) | last-token rows (B_max) ]

where ``T`` is the largest bucket's token count. Row ``b`` of a bucket is tokens
``b*L .. b*L+L-1``; padding (after a prompt, and whole unused rows) has token id 0 and writes
its KV to the scratch block past the block manager's range, so real blocks are never touched.

Graphs are captured largest first into one shared memory pool (they never run concurrently,
so their intermediates can share memory), after warm-up runs on a side stream. Capture inputs
are all padding, so capture writes only the scratch block.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from slipstream.agent.engine.config import ShortPrefillBuckets
from slipstream.agent.engine.step.graph_capture import capture_graph
from slipstream.agent.engine.models.llama import KVCache, LlamaForCausalLM
from slipstream.agent.engine.step.prefill_buckets import (
    PrefillBucket, all_buckets, select_bucket, short_prefill_lengths)
from slipstream.agent.scheduler.batch import ScheduledChunk
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE, blocks_for_tokens
from slipstream.kernels.padded_prefill import PaddedPrefillAttention

log = logging.getLogger(__name__)

PAD_TOKEN_ID = 0  # any valid id: padded rows are computed and then ignored


@dataclass
class _BucketProgram:
    """One bucket's fixed-address inputs, attention object and, on CUDA, its graph."""

    bucket: PrefillBucket
    token_ids: torch.Tensor  # [B*L] views into the shared input buffer
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_rows: torch.Tensor  # [B]
    attention: PaddedPrefillAttention
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the graph's output [B, vocab], rewritten per replay


class ShortPrefillExecutor:
    """Runs batches of whole fresh prompts in padded static buckets.

    ``kv_caches`` must hold one block more than the block manager uses: block
    ``scratch_block`` absorbs the padding's KV writes.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                 buckets: ShortPrefillBuckets, scratch_block: int,
                 device: torch.device) -> None:
        if kv_caches and kv_caches[0][0].shape[0] <= scratch_block:
            raise ValueError(f"the KV cache has no scratch block {scratch_block}")
        self.model = model
        self.kv_caches = kv_caches
        self.config = buckets
        self.device = device
        self.scratch_block = scratch_block
        self.buckets = all_buckets(buckets)
        self.max_tokens = max(bucket.padded_tokens for bucket in self.buckets)
        self.max_batch = max(buckets.batch_sizes)
        size = 3 * self.max_tokens + self.max_batch
        self._inputs = torch.zeros(size, dtype=torch.int64, device=device)
        # Pinned staging memory makes the one host-to-device copy per step a plain DMA.
        self._staging = torch.zeros(size, dtype=torch.int64,
                                    pin_memory=device.type == "cuda")
        # Padding's KV slots: spread over the scratch block (which padded write wins a slot
        # is irrelevant). Until the first real batch every slot is scratch, so warm-up and
        # capture runs write only the scratch block.
        self._scratch_slots = scratch_block * BLOCK_SIZE + torch.arange(
            self.max_tokens) % BLOCK_SIZE
        self._block_offsets = torch.arange(BLOCK_SIZE)
        self._staging[2 * self.max_tokens:3 * self.max_tokens] = self._scratch_slots
        self._inputs.copy_(self._staging)
        self._programs = {bucket: self._program(bucket) for bucket in self.buckets}
        self.use_graphs = False
        # Batches run per bucket since start-up: how often the padded path (and, on CUDA,
        # each graph) was used.
        self.runs_per_bucket: Counter[PrefillBucket] = Counter()
        # Start-up cost of capture(): seconds, and device memory it reserved (the shared
        # graph pool plus what warm-up left cached).
        self.capture_s: float | None = None
        self.capture_reserved_bytes: int | None = None

    def _program(self, bucket: PrefillBucket) -> _BucketProgram:
        tokens, total = bucket.padded_tokens, self.max_tokens
        inputs = self._inputs
        slot_mapping = inputs[2 * total:2 * total + tokens]
        return _BucketProgram(
            bucket=bucket, token_ids=inputs[:tokens], positions=inputs[total:total + tokens],
            slot_mapping=slot_mapping,
            last_rows=inputs[3 * total:3 * total + bucket.batch_size],
            attention=PaddedPrefillAttention(slot_mapping, bucket.batch_size,
                                             bucket.length_tokens))

    @property
    def num_graphs(self) -> int:
        return sum(1 for program in self._programs.values() if program.graph is not None)

    def select(self, chunks: Sequence[ScheduledChunk]) -> PrefillBucket | None:
        lengths = short_prefill_lengths(chunks)
        if lengths is None:
            return None
        return select_bucket(self.buckets, lengths, self.config.max_padding_factor)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one CUDA graph per bucket (CUDA only), largest first, one shared pool."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; on CPU the padded path runs "
                               "eagerly")
        started, reserved_before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.buckets, reverse=True,
                             key=lambda b: (b.padded_tokens, b.length_tokens)):
            program = self._programs[bucket]
            program.graph, program.logits = capture_graph(
                functools.partial(self._forward, program), self.device, pool)
        torch.cuda.synchronize(self.device)
        self.use_graphs = True
        self.capture_s = time.perf_counter() - started
        reserved = self.capture_reserved_bytes = \
            torch.cuda.memory_reserved(self.device) - reserved_before
        log.info("captured %d CUDA graphs for short prefills (lengths %s x batches %s) in "
                 "%.1f s, %.2f GiB reserved", self.num_graphs, self.config.lengths_tokens,
                 self.config.batch_sizes, self.capture_s, reserved / 2**30)

    def run(self, chunks: Sequence[ScheduledChunk], bucket: PrefillBucket) -> torch.Tensor:
        """Logits ``[len(chunks), vocab]`` (float32) at each prompt's last token."""
        self.load_inputs(chunks, bucket)
        return self.forward(bucket, len(chunks))

    def forward(self, bucket: PrefillBucket, num_prompts: int) -> torch.Tensor:
        """Run ``bucket`` on the inputs last loaded into it (graph replay on CUDA)."""
        program = self._programs[bucket]
        self.runs_per_bucket[bucket] += 1
        if self.use_graphs and program.graph is not None and program.logits is not None:
            program.graph.replay()
            # The next replay of this bucket overwrites its output tensor.
            return program.logits[:num_prompts].clone()
        return self._forward(program)[:num_prompts]

    def _forward(self, program: _BucketProgram) -> torch.Tensor:
        hidden = self.model(program.token_ids, program.positions, self.kv_caches,
                            program.attention)
        return self.model.compute_logits(hidden.index_select(0, program.last_rows))

    def load_inputs(self, chunks: Sequence[ScheduledChunk], bucket: PrefillBucket) -> None:
        length, batch = bucket.length_tokens, bucket.batch_size
        tokens = bucket.padded_tokens
        if (len(chunks) > batch or any(c.num_tokens > length for c in chunks)
                or short_prefill_lengths(chunks) is None):
            raise ValueError(f"these {len(chunks)} chunks are not whole fresh prompts that fit "
                             f"bucket {bucket}")
        total, staging = self.max_tokens, self._staging
        token_ids = staging[:tokens]
        slots = staging[2 * total:2 * total + tokens]
        last_rows = staging[3 * total:3 * total + batch]
        # Padding first; then each prompt overwrites the front of its row.
        token_ids.fill_(PAD_TOKEN_ID)
        staging[total:total + tokens] = torch.arange(length).repeat(batch)
        slots.copy_(self._scratch_slots[:tokens])
        last_rows.copy_(torch.arange(batch) * length)  # unused rows: any row of their own
        for row, chunk in enumerate(chunks):
            base, count = row * length, chunk.num_tokens
            token_ids[base:base + count] = torch.tensor(chunk.token_ids)
            table = torch.tensor(chunk.block_ids[:blocks_for_tokens(count)])
            slots[base:base + count] = (table[:, None] * BLOCK_SIZE
                                        + self._block_offsets).flatten()[:count]
            last_rows[row] = base + count - 1
        self._inputs.copy_(staging)
