"""One worker's share of the model: its TP shard of its pipeline stage, for its KVP group.

    Batch (same description on every rank)
      -> inputs + this KVP group's attention metadata
      -> first stage: embed; later stages: recv the residual stream from the previous stage
      -> this stage's decoder layers (TP all-reduces and KVP merges happen inside the layers)
      -> not last stage: send to the next stage (asynchronously: this stage moves on at once)
         last stage, KVP group 0: logits (vocab-parallel) -> the sampler rank samples (with
         the step's grammar masks from the controller, if any rows are under a grammar)

Each batch's compute span is recorded, so a test (or a trace viewer) can see the pipeline
overlap: stage 0 starting chunk i+1 while stage 1 still works on chunk i.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.models.loader import load_model, resolve_dtype, weight_source
from slipstream.agent.engine.kv.memory import allocate_kv_tensor
from slipstream.agent.engine.step.model_runner import plan_kv_blocks
from slipstream.agent.engine.step.batch_io import FlatInputs, SampledToken, sample_batch
from slipstream.agent.engine.models.cpu_matmul import apply_cpu_matmul
from slipstream.agent.engine.models.layers import LocalLayers, PipelineStage
from slipstream.agent.engine.sampling.sampler import MaskSource, Sampler
from slipstream.agent.parallel.groups import ProcessGroups
from slipstream.agent.parallel.kv_parallel import KVParallelBackend, group_metadata
from slipstream.agent.parallel.layers import TensorParallelLayers
from slipstream.agent.scheduler.batch import Batch, BlockCopy
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.kernels.attention import select_backend

MAX_SPANS = 4096
_WHOLE_SEQUENCE_TOKENS = 1 << 62  # "one KVP group holds everything"


@dataclass(frozen=True)
class StageSpan:
    """When one rank computed one batch (``time.monotonic()`` seconds, system-wide on Linux)."""

    batch_seq: int
    rank: int
    stage: int
    kvp_group: int
    num_tokens: int
    start_s: float
    end_s: float


class StageRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, groups: ProcessGroups,
                 device: torch.device) -> None:
        parallel, coords = groups.config, groups.coords
        self.groups = groups
        self.device = device
        self.dtype = resolve_dtype(config.dtype, model_config, device)
        self.hidden_size = model_config.hidden_size
        torch.manual_seed(config.seed)
        self.stage = PipelineStage.split(model_config.num_layers, parallel.spp, coords.stage)
        layers = TensorParallelLayers(groups) if parallel.tp > 1 or parallel.ep > 1 \
            else LocalLayers()
        self.model = load_model(config.model_dir, device, self.dtype, model_config, layers,
                                self.stage, load_format=config.load_format,
                                weights=weight_source(config))
        # Tensor-parallel layers bring their own matmuls and communication; plain ones (a
        # pipeline stage, a KV-parallel rank) take oneDNN's reordered weights like one process.
        self.cpu_matmul = (apply_cpu_matmul(self.model, config.cpu_matmul, device, self.dtype)
                           if parallel.tp == 1 else "torch")
        backend = select_backend(device, config.attention_backend)
        self.backend = backend
        if parallel.kvp > 1:
            if groups.kvp_group is None:
                raise RuntimeError(f"rank {coords.rank}: kvp={parallel.kvp} without a KVP group")
            self.backend = KVParallelBackend(backend, groups.kvp_group, parallel.kvp)
        self.tokens_per_group = (parallel.kvp_tokens_per_group if parallel.kvp > 1
                                 else _WHOLE_SEQUENCE_TOKENS)
        self.kv_group = coords.kvp_group
        local_kv_heads = layers.local_count(model_config.num_kv_heads)
        num_layers = len(self.stage.layer_indices)
        self.num_kv_blocks = plan_kv_blocks(
            config, model_config, device, self.dtype, num_layers * local_kv_heads,
            ranks_sharing_memory=parallel.world_size if device.type == "cpu" else 1).num_blocks
        shape = (self.num_kv_blocks, BLOCK_SIZE, local_kv_heads, model_config.head_dim)
        self.kv_caches = [(allocate_kv_tensor(shape, self.dtype, device),
                           allocate_kv_tensor(shape, self.dtype, device))
                          for _ in range(num_layers)]
        self.computes_logits = self.stage.is_last and coords.kvp_group == 0
        self.is_sampler = coords.rank == parallel.sampler_rank
        self.sampler = Sampler(config.seed) if self.is_sampler else None
        self.spans: deque[StageSpan] = deque(maxlen=MAX_SPANS)
        # The hand-off in flight (isend's request, None once complete) and its tensor.
        self._pending_send: tuple[dist.Work | None, torch.Tensor] | None = None

    @torch.inference_mode()
    def run(self, batch_seq: int, batch: Batch, masks: MaskSource | None = None
            ) -> dict[str, SampledToken] | None:
        """Run this rank's part of ``batch``; the sampler rank returns the sampled tokens.
        ``masks`` (sampler rank, a batch with guided rows) gives their grammar masks; it is
        called after the forward."""
        for copy in batch.swap_out + batch.swap_in:
            self._copy_blocks(copy)
        if not batch.chunks:
            return {} if self.is_sampler else None
        input_ids, positions, sample_rows = self._prepare(batch)
        hidden_in = None
        if not self.stage.is_first:
            hidden_in = torch.empty(len(positions), self.hidden_size, dtype=self.dtype,
                                    device=self.device)
            dist.recv(hidden_in, src=self.groups.prev_rank)
        started = time.monotonic()
        hidden = self.model(input_ids, positions, self.kv_caches, self.backend, hidden_in)
        logits = None
        if self.computes_logits:
            logits = self.model.compute_logits(hidden[[row for _, row in sample_rows]])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        coords = self.groups.coords
        self.spans.append(StageSpan(batch_seq, coords.rank, coords.stage, coords.kvp_group,
                                    len(positions), started, time.monotonic()))
        if not self.stage.is_last:
            self._send(hidden)
        if self.sampler is None:  # only the sampler rank has one
            return None
        if logits is None:
            raise RuntimeError(f"rank {coords.rank} samples but computed no logits (sampler_rank "
                               "must be a last-stage rank of KVP group 0)")
        return sample_batch(self.sampler, batch, sample_rows, logits, masks)

    def finish_sends(self) -> None:
        if self._pending_send is not None:
            work, _ = self._pending_send
            if work is not None:
                work.wait()
            self._pending_send = None

    def _send(self, hidden: torch.Tensor) -> None:
        # Wait for the previous hand-off only now, so this stage computed the next batch
        # while the last one was in transit.
        self.finish_sends()
        hidden = hidden.contiguous()
        self._pending_send = (dist.isend(hidden, dst=self.groups.next_rank), hidden)

    def _prepare(self, batch: Batch):
        flat = FlatInputs.of(batch.chunks)
        metadata = group_metadata(batch.chunks, self.kv_group, self.tokens_per_group, BLOCK_SIZE,
                                  self.device)
        self.backend.plan(metadata)
        input_ids, positions = flat.tensors(self.device)
        return input_ids, positions, flat.sample_rows

    def _copy_blocks(self, copy: BlockCopy) -> None:
        # Swap to host memory is not wired for parallel workers yet: the engine gives them no
        # host pool, so the scheduler never emits swaps. Fail loudly if that changes.
        raise NotImplementedError("swap preemption is not supported with parallel workers")

