"""``slipstream profile``: measure per-layer operation times of the real engine on the real
device, and write them as a profile directory for the runtime predictor.

    model dir -> ModelRunner (the serving code path) -> time each op of layer 0 on a grid
        -> write_profile(): <op>.csv tables + profile.json -> RuntimePredictor -> packer

Tables follow the Vidur layout the predictor also reads for the H100 data: linear ops keyed by
token count; ``attn_prefill`` by (KV tokens cached before the chunk, chunk tokens);
``attn_decode`` by (decode batch size, KV tokens read by the whole batch). Times are the
fastest of repeated runs after a warm-up, in milliseconds per layer, made to grow with every
key (``lower_envelope``). Two overheads of ``a + b * sequences`` cover what the layer tables
do not (step_calibration.py):

- the runner's: embedding, final norm, LM head, sampling, tensor preparation, decode padding;
- the engine's host work around the runner: scheduling, state update, output processing.

Both are fitted on the steps the real ``LLMEngine`` runs on a small serving load packed with
these tables, so the predictor covers a whole engine step, as the packer's budget and the
simulator's clock need. A first, rough runner overhead from random batches only lets that
engine pack sensibly.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.kv.tier_store import (
    measure_disk_read_gb_per_s, measure_host_load_gb_per_s)
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.llama import LlamaDecoderLayer, LlamaMLP
from slipstream.agent.engine.models.norm_rope import apply_rotary
from slipstream.agent.engine.profile.moe_profile import (DENSE_MLP_OPS, MOE_OP, mlp_op_counts,
                                                 moe_model_fields)
from slipstream.agent.engine.profile.fit import fit_overhead, lower_envelope
from slipstream.agent.engine.profile.grids import PROFILE_GRIDS, ProfileGrid
from slipstream.agent.engine.profile.step_calibration import (
    CalibrationLoad, fastest_steps, fit_host_overhead, fit_runner_overhead, prefill_tokens,
    time_engine_steps)
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import (RuntimePredictor, model_floor_target_ms,
                                                  predict_batch_time_ms)
from slipstream.agent.scheduler.profile_table import ProfileMeta, write_profile
from slipstream.contracts.sampling import SamplingOptions
from slipstream.kernels.attention import AttentionMetadata



def best_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
            max_ms: float | None = None) -> float:
    """The fastest of ``repeats`` timed runs, in ms. Interference from other processes only
    ever adds time, so the minimum is the most repeatable estimate on a shared machine.

    With ``max_ms`` (the quick grid of a server's first start), a point is warmed up once and
    stops once its runs took that long, after at least one timed run: a slow point is measured
    fewer times, and its noise is a smaller share of it."""
    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) * 1000

    spent = 0.0
    for _ in range(warmup if max_ms is None else min(warmup, 1)):
        spent += timed()
    samples: list[float] = []
    for _ in range(repeats):
        samples.append(timed())
        spent += samples[-1]
        if max_ms is not None and spent > max_ms:
            break
    return min(samples)


class Profiler:
    def __init__(self, runner: ModelRunner, repeats: int = 7,
                 max_point_ms: float | None = None) -> None:
        self.runner = runner
        self.device = runner.device
        self.repeats = repeats
        self.max_point_ms = max_point_ms  # see best_ms
        # ModuleDict hands out plain Modules; these are the model's decoder layers.
        self.layers = cast(list[LlamaDecoderLayer], list(runner.model.model.layers.values()))
        self.layer = self.layers[0]
        self.config = runner.model_config

    def _hidden(self, tokens: int) -> torch.Tensor:
        return torch.randn(tokens, self.config.hidden_size, device=self.device,
                           dtype=self.runner.dtype)

    def linear_ops(self, tokens: int) -> dict[str, float]:
        """Each op run on every layer back to back, per layer: in a forward a layer's weights
        come from memory, not from the cache a repeated single-layer call keeps them in, and
        some small-batch matmul kernels re-read their weights (cold, two or three tokens can
        cost twice one)."""
        attn = self.layer.self_attn
        # A mixture of experts times its sparse layers whole (moe_profile.py), on the layers
        # that have them; the dense MLP ops run on the dense layers.
        dense = [layer for layer in self.layers if isinstance(layer.mlp, LlamaMLP)]
        sparse = [layer for layer in self.layers if not isinstance(layer.mlp, LlamaMLP)]
        x = self._hidden(tokens)
        q, k, _ = attn.qkv(x)
        positions = torch.arange(tokens, device=self.device)
        cos, sin = self.runner.model.model.rotary(positions, x.dtype)
        gate, _ = cast(LlamaMLP, dense[0].mlp).gate_up(x) if dense else (x, x)
        attn_out = torch.randn(tokens, attn.num_heads * attn.head_dim, device=self.device,
                               dtype=x.dtype)
        intermediate = torch.randn_like(gate)
        ops: dict[str, Callable[[LlamaDecoderLayer], object]] = {
            "input_layernorm": lambda layer: layer.input_layernorm(x),
            "post_attention_layernorm": lambda layer: layer.post_attention_layernorm(x),
            "attn_pre_proj": lambda layer: layer.self_attn.qkv(x),
            "attn_rope": lambda _: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
            "attn_post_proj": lambda layer: layer.self_attn.o_proj(attn_out),
            "mlp_up_proj": lambda layer: cast(LlamaMLP, layer.mlp).gate_up(x),
            "mlp_act": lambda _: F.silu(gate) * intermediate,
            "mlp_down_proj": lambda layer: cast(LlamaMLP, layer.mlp).down_proj(intermediate),
            "add": lambda _: (x + x, x + x),
            MOE_OP: lambda layer: layer.mlp(x),
        }

        def layers_of(name: str) -> list[LlamaDecoderLayer]:
            return dense if name in DENSE_MLP_OPS else sparse if name == MOE_OP \
                else self.layers

        def on_layers(op: Callable[[LlamaDecoderLayer], object],
                      layers: list[LlamaDecoderLayer]) -> Callable[[], object]:
            return lambda: [op(layer) for layer in layers]

        return {name: best_ms(on_layers(op, layers_of(name)), self.device, self.repeats,
                              max_ms=self.max_point_ms) / len(layers_of(name))
                for name, op in ops.items() if layers_of(name)}

    def _attention_ms(self, chunks: list[tuple[int, int]]) -> float:
        """Per-layer attention time for chunks given as (kv_before, query_len)."""
        tables, slots, next_block = [], [], 0
        for kv_before, query_len in chunks:
            num_blocks = -(-(kv_before + query_len) // BLOCK_SIZE)
            table = list(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            tables.append(table)
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(kv_before, kv_before + query_len)]
        if next_block > self.runner.num_kv_blocks:
            raise ValueError(f"profiling needs {next_block} KV blocks; start with more")
        metadata = AttentionMetadata.build(
            query_lens=[q for _, q in chunks], kv_lens=[kv + q for kv, q in chunks],
            query_start_pos=[kv for kv, _ in chunks], block_tables=tables,
            slot_mapping=slots, block_size=BLOCK_SIZE, device=self.device)
        backend = self.runner.backend
        backend.plan(metadata)
        attn = self.layer.self_attn
        query = torch.randn(metadata.num_tokens, attn.num_heads, attn.head_dim,
                            device=self.device, dtype=self.runner.dtype)
        k_cache, v_cache = self.runner.kv_caches[0]
        return best_ms(lambda: backend.run(query, k_cache, v_cache, attn.scale,
                                             return_lse=False), self.device, self.repeats,
                       max_ms=self.max_point_ms)

    def prefill_attention(self, kv_before: int, chunk: int) -> float:
        return self._attention_ms([(kv_before, chunk)])

    def decode_attention(self, batch: int, kv_total: int) -> float:
        """Decodes whose KV lengths spread evenly from short to twice the mean, as requests
        at different points of their lives do. The total is the table key; the spread
        matters to backends that pad: the torch reference pads each group of similar KV
        lengths to the group's longest."""
        mean = kv_total / batch
        lengths = [max(1, round(2 * mean * (i + 0.5) / batch)) for i in range(batch)]
        return self._attention_ms([(kv - 1, 1) for kv in lengths])


GREEDY = SamplingOptions(temperature=0.0)


def calibration_batches(rng: np.random.Generator, count: int, max_kv: int) -> list[Batch]:
    """Random mixes of decodes and prefill chunks, laid out in disjoint KV blocks."""
    batches = []
    for _ in range(count):
        shapes = [(int(rng.integers(16, max_kv)), 1) for _ in range(int(rng.integers(0, 24)))]
        shapes += [(int(rng.integers(0, 4)) * 256, int(rng.choice([32, 96, 200, 384, 512])))
                   for _ in range(int(rng.integers(0 if shapes else 1, 3)))]
        chunks, next_block = [], 0
        for index, (kv_before, query_len) in enumerate(shapes):
            num_blocks = -(-(kv_before + query_len) // BLOCK_SIZE)
            table = tuple(range(next_block, next_block + num_blocks))
            next_block += num_blocks
            chunks.append(ScheduledChunk(f"c{index}", tuple(rng.integers(10, 1000, query_len)
                                                            .tolist()), kv_before, table, True,
                                         GREEDY))  # as the engine calibration samples
        batches.append(Batch(chunks=tuple(chunks)))
    return batches


def predict_ms(predictor: RuntimePredictor, batch: Batch) -> float:
    """The predictor's time for ``batch``: prefills as (chunk, KV after), decodes by KV."""
    prefills = [(c.num_tokens, c.end_pos) for c in batch.chunks if c.num_tokens > 1]
    decode_kv_lens = [c.end_pos for c in batch.chunks if c.num_tokens == 1]
    return predict_batch_time_ms(predictor, prefills, decode_kv_lens)


def measure_execute_ms(runner: ModelRunner, batch: Batch, repeats: int = 5,
                       max_ms: float | None = None) -> float:
    return best_ms(lambda: runner.execute(batch), runner.device, repeats, warmup=1, max_ms=max_ms)


def measure_tables(profiler: Profiler, grid: ProfileGrid, progress: tqdm) -> dict[str, np.ndarray]:
    """Every op of one layer on the grid, ms per layer, made to grow with every key."""
    tables: dict[str, list] = {}
    for tokens in grid.tokens:
        for op, ms in profiler.linear_ops(tokens).items():
            tables.setdefault(op, []).append((tokens, ms))
        progress.update()
    for kv_before in grid.prefill_kv:
        for chunk in grid.prefill_chunk:
            tables.setdefault("attn_prefill", []).append(
                (kv_before, chunk, profiler.prefill_attention(kv_before, chunk)))
            progress.update()
    for batch in grid.decode_batch:
        for kv_total in grid.decode_kv:
            tables.setdefault("attn_decode", []).append(
                (batch, kv_total, profiler.decode_attention(batch, kv_total)))
            progress.update()
    return {op: lower_envelope(np.array(rows)) for op, rows in tables.items()}


def random_batch_residuals(runner: ModelRunner, profile_dir: Path,
                           grid: ProfileGrid) -> list[tuple[int, int, float]]:
    """(sequences, prefill tokens, execute - tables ms) over random mixed batches: decodes
    with KV up to 2K next to prefill chunks, shapes a serving load may not reach."""
    predictor = RuntimePredictor.from_directory(profile_dir, cache_dir=None)
    return [(len(batch.chunks), prefill_tokens(batch),
             measure_execute_ms(runner, batch, grid.calibration_repeats, grid.max_point_ms)
             - predict_ms(predictor, batch))
            for batch in calibration_batches(np.random.default_rng(0), grid.calibration_batches,
                                             2048)]


def fit_on_engine_steps(model_dir: Path, device: str, profile_dir: Path, load: CalibrationLoad,
                        random_batches: Sequence[tuple[int, int, float]],
                        meta: ProfileMeta, dtype: str = "auto",
                        cpu_matmul: str = "auto",
                        served: EngineConfig | None = None) -> ProfileMeta:
    """``meta`` with the runner and host overheads, fitted on the steps the real LLMEngine runs when it
    packs a serving load with this profile (see step_calibration.py); the runner's also on
    ``random_batches``, with as much weight in total as the engine steps."""
    # The packer must fit a prefill chunk next to the decodes, also on a model slower than the
    # usual 50 ms target (a ~100M model on one CPU core takes ~50 ms for 32 tokens).
    bootstrap = RuntimePredictor.from_directory(profile_dir, cache_dir=None)
    target_ms = max(50.0, model_floor_target_ms(bootstrap))
    engine = LLMEngine(as_served(EngineConfig(model_dir=model_dir, device=device, dtype=dtype,
                                              profile_dir=profile_dir, num_kv_blocks=4096,
                                              cpu_matmul=cpu_matmul), served),
                       SchedulerConfig(target_batch_time_ms=target_ms))
    try:
        # A new engine's first steps pay one-time costs: on CUDA lazy kernel loading, cuBLAS
        # heuristics per new GEMM shape, the caching allocator growing (H200, 100m preset: 64
        # ms of fitted fixed overhead per step cold, 4 ms warm); on a CPU oneDNN's kernels per
        # new matmul shape and the KV cache's first touch (bench MoE: 0.08-0.11 ms per
        # sequence cold, 0.04-0.06 warm, which a steady batch of 32 decodes pays). Serving
        # runs warm; so does the fit: the same batches first, from other prompts (no
        # prefix-cache hits), then the fastest of two timed runs of them.
        time_engine_steps(engine, load, tokens_salt=1)
        timings = fastest_steps([time_engine_steps(engine, load, tokens_salt=2),
                                 time_engine_steps(engine, load)])
    finally:
        engine.close()
    tables_only = RuntimePredictor.from_directory(
        profile_dir, meta=ProfileMeta(**{**dataclasses.asdict(bootstrap.meta),
                                         "iteration_overhead_ms": 0.0,
                                         "per_sequence_overhead_ms": 0.0,
                                         "per_prefill_token_overhead_ms": 0.0}),
        cache_dir=None)
    # One sample per random batch, not enough copies to match the engine steps: each random
    # batch is timed once or a few times, and on SmolLM2 (quick grid) four of them were off
    # the tables by -420 to +600 ms; copied to the engine steps' weight they set a 37 ms
    # per-sequence overhead, where 32 decodes measure 195 ms against 1,319 ms predicted.
    runner_ms, runner_per_sequence_ms, runner_per_token_ms = fit_runner_overhead(
        timings, lambda batch: predict_ms(tables_only, batch), list(random_batches))
    host_ms, host_per_sequence_ms = fit_host_overhead(timings)
    return dataclasses.replace(meta, iteration_overhead_ms=runner_ms,
                               per_sequence_overhead_ms=runner_per_sequence_ms,
                               per_prefill_token_overhead_ms=runner_per_token_ms,
                               host_overhead_ms=host_ms, host_per_sequence_ms=host_per_sequence_ms)


def as_served(config: EngineConfig, served: EngineConfig | None) -> EngineConfig:
    """``config`` running the kernels, graphs and weight source of the served config."""
    if served is None:
        return config
    return dataclasses.replace(config, attention_backend=served.attention_backend,
                               cuda_graphs=served.cuda_graphs, load_format=served.load_format,
                               # Compiled CPU decodes are left out: compiling costs seconds
                               # per engine, and the fit then slightly over-predicts
                               # decode steps of up to four sequences (docs/quantization.md).
                               cpu_compile=False,
                               quantization=served.quantization,
                               quantization_group_size=served.quantization_group_size,
                               gguf_file=served.gguf_file)


def profile(model_dir: Path, device: str, out: Path, repeats: int,
            grid: ProfileGrid = ProfileGrid(), dtype: str = "auto",
            cpu_matmul: str = "auto", served: EngineConfig | None = None) -> Path:
    """Measure the profile of ``model_dir`` into ``out``; ``served`` (the config that will be
    served) gives the attention backend, CUDA graphs and weight source to measure with."""
    model_config = ModelConfig.from_dir(model_dir)
    # Calibration batches hold up to 24 decodes of 2K tokens plus three prefill chunks; the
    # largest prefill point holds its prefix and chunk.
    needed_blocks = max(2 * max(grid.decode_kv), 60_000,
                        max(grid.prefill_kv) + max(grid.prefill_chunk)) // BLOCK_SIZE + 64
    # The per-layer tables time single ops eagerly: no decode graphs to capture here.
    runner = ModelRunner(dataclasses.replace(
        as_served(EngineConfig(model_dir=model_dir, device=device, dtype=dtype,
                               num_kv_blocks=needed_blocks, cpu_matmul=cpu_matmul), served),
        cuda_graphs=False, cpu_compile=False), model_config)
    steps = len(grid.tokens) + len(grid.prefill_kv) * len(grid.prefill_chunk) + \
        len(grid.decode_batch) * len(grid.decode_kv) + 2
    meta = ProfileMeta(num_layers=model_config.num_layers, device=str(runner.device),
                       model={"name": model_dir.name, "hidden_size": model_config.hidden_size,
                              "num_attention_heads": model_config.num_heads,
                              "num_key_value_heads": model_config.num_kv_heads,
                              "intermediate_size": model_config.intermediate_size,
                              **moe_model_fields(model_config)},
                       op_counts_per_layer=mlp_op_counts(model_config),
                       linear_profiled_max_tokens=max(grid.tokens),
                       # KV tiers: host -> device copies, and reads from the cache's disk.
                       host_load_gb_per_s=measure_host_load_gb_per_s(runner.device,
                                                                     runner.dtype),
                       disk_read_gb_per_s=measure_disk_read_gb_per_s(out))
    with torch.inference_mode(), tqdm(total=steps, unit="point", desc="profiling",
                                      mininterval=2.0) as progress:
        tables = measure_tables(Profiler(runner, repeats, grid.max_point_ms), grid, progress)
        write_profile(out, tables, meta)
        # Random batches first: a rough overhead, so the engine below packs sensibly.
        random_batches = random_batch_residuals(runner, out, grid)
        fixed_ms, per_sequence_ms = fit_overhead([n for n, _, _ in random_batches],
                                                 [ms for _, _, ms in random_batches])
        meta = dataclasses.replace(meta, iteration_overhead_ms=fixed_ms,
                                   per_sequence_overhead_ms=per_sequence_ms)
        write_profile(out, tables, meta)
        progress.update()
        del runner  # the engine below loads its own copy of the weights
        meta = fit_on_engine_steps(model_dir, device, out, grid.engine_load, random_batches,
                                   meta, dtype, cpu_matmul, served)
        progress.update()
    write_profile(out, tables, meta)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="Hugging Face model directory; default: the embedded tiny model")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--out", type=Path, required=True, help="profile directory to write")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per grid point")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        default="auto", help="as `slipstream serve --dtype`")
    parser.add_argument("--cpu-matmul", choices=("auto", "onednn", "torch"), default="auto",
                        help="as `slipstream serve --cpu-matmul` (profile what you will serve)")
    parser.add_argument("--grid", choices=sorted(PROFILE_GRIDS), default="full",
                        help="grid size: 'small' profiles a ~100M-parameter CPU model in minutes; "
                             "'quick' is what `slipstream serve` measures on its first start")


def run(args: argparse.Namespace) -> int:
    from slipstream.agent.engine.models.tiny_model import ensure_default_model

    model_dir = args.model or ensure_default_model()
    out = profile(model_dir, args.device, args.out, args.repeats, PROFILE_GRIDS[args.grid],
                  dtype=args.dtype, cpu_matmul=args.cpu_matmul)
    print(f"wrote profile of {model_dir.name} to {out}")
    return 0
