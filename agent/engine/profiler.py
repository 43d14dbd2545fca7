"""``slipstream profile``: measure per-layer operation times of the real engine on the real
device, and write them as a profile directory for the runtime predictor.

    model dir -> ModelRunner (the serving code path) -> time each op of layer 0 on a grid
        -> write_profile(): <op>.csv tables + profile.json -> RuntimePredictor -> packer

Tables follow the Vidur layout the predictor also reads for the H100 data: linear ops keyed by
token count; ``attn_prefill`` by (KV tokens cached before the chunk, chunk tokens);
``attn_decode`` by (decode batch size, KV tokens read by the whole batch). Times are the
fastest of repeated runs after a warm-up, in milliseconds per layer. What the layer tables do
not cover (embedding, final norm, LM head, sampling, tensor preparation) is calibrated at the
end as an overhead of ``a + b * sequences``, fitted on whole ``ModelRunner.execute`` calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.model_runner import ModelRunner
from slipstream.agent.engine.models.llama import apply_rotary
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.predictor import RuntimePredictor, predict_batch_time_ms
from slipstream.agent.scheduler.profile_table import ProfileMeta, write_profile
from slipstream.kernels.attention import AttentionMetadata

TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_KV_GRID = (0, 256, 512, 1024, 2048, 4096)
PREFILL_CHUNK_GRID = (32, 64, 128, 256, 512, 1024)
DECODE_BATCH_GRID = (1, 2, 4, 8, 16, 32, 64)
DECODE_KV_GRID = (256, 1024, 4096, 16384, 32768)


def best_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """The fastest of ``repeats`` timed runs, in ms. Interference from other processes only
    ever adds time, so the minimum is the most repeatable estimate on a shared machine."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - started) * 1000)
    return min(samples)


class Profiler:
    def __init__(self, runner: ModelRunner, repeats: int = 7) -> None:
        self.runner = runner
        self.device = runner.device
        self.repeats = repeats
        self.layer = next(iter(runner.model.model.layers.values()))
        self.config = runner.model_config

    def _hidden(self, tokens: int) -> torch.Tensor:
        return torch.randn(tokens, self.config.hidden_size, device=self.device,
                           dtype=self.runner.dtype)

    def linear_ops(self, tokens: int) -> dict[str, float]:
        layer, attn, mlp = self.layer, self.layer.self_attn, self.layer.mlp
        x = self._hidden(tokens)
        q = attn.q_proj(x).view(tokens, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(tokens, attn.num_kv_heads, attn.head_dim)
        positions = torch.arange(tokens, device=self.device)
        cos, sin = self.runner.model.model.rotary(positions, x.dtype)
        gate = mlp.gate_proj(x)
        attn_out = torch.randn(tokens, attn.num_heads * attn.head_dim, device=self.device,
                               dtype=x.dtype)
        intermediate = torch.randn_like(gate)
        ops: dict[str, Callable[[], object]] = {
            "input_layernorm": lambda: layer.input_layernorm(x),
            "post_attention_layernorm": lambda: layer.post_attention_layernorm(x),
            "attn_pre_proj": lambda: (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)),
            "attn_rope": lambda: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)),
            "attn_post_proj": lambda: attn.o_proj(attn_out),
            "mlp_up_proj": lambda: (mlp.gate_proj(x), mlp.up_proj(x)),
            "mlp_act": lambda: F.silu(gate) * intermediate,
            "mlp_down_proj": lambda: mlp.down_proj(intermediate),
            "add": lambda: (x + x, x + x),
        }
        return {name: best_ms(fn, self.device, self.repeats) for name, fn in ops.items()}

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
                                             return_lse=False), self.device, self.repeats)

    def prefill_attention(self, kv_before: int, chunk: int) -> float:
        return self._attention_ms([(kv_before, chunk)])

    def decode_attention(self, batch: int, kv_total: int) -> float:
        per_request = max(kv_total // batch, 1)
        return self._attention_ms([(per_request - 1, 1)] * batch)


def monotone_envelope(rows: np.ndarray) -> np.ndarray:
    """Clip each measurement to the cheapest measurement of a larger shape.

    Every op here costs at least as much for more tokens (or more KV, or a bigger batch).
    A point above a larger point was slowed by something else, typically another process
    taking a core in the middle of a two-thread kernel, which best-of-N cannot always
    remove: on a busy machine a 2-token GEMM measured 40 ms while 2,048 tokens took 0.3 ms.
    Rows are ``(x, ms)`` or ``(x0, x1, ms)`` on a full grid.
    """
    rows = np.array(rows, dtype=np.float64)
    if rows.shape[1] == 2:
        order = np.argsort(rows[:, 0], kind="stable")
        rows[order, 1] = np.minimum.accumulate(rows[order, 1][::-1])[::-1]
        return rows
    for key, other in ((0, 1), (1, 0)):  # non-decreasing along each axis
        for value in np.unique(rows[:, key]):
            line = np.flatnonzero(rows[:, key] == value)
            line = line[np.argsort(rows[line, other], kind="stable")]
            rows[line, 2] = np.minimum.accumulate(rows[line, 2][::-1])[::-1]
    return rows


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
                                                            .tolist()), kv_before, table, True))
        batches.append(Batch(chunks=tuple(chunks)))
    return batches


def predict_ms(predictor: RuntimePredictor, batch: Batch) -> float:
    """The predictor's time for ``batch``: prefills as (chunk, KV after), decodes by KV."""
    prefills = [(c.num_tokens, c.end_pos) for c in batch.chunks if c.num_tokens > 1]
    decode_kv_lens = [c.end_pos for c in batch.chunks if c.num_tokens == 1]
    return predict_batch_time_ms(predictor, prefills, decode_kv_lens)


def measure_execute_ms(runner: ModelRunner, batch: Batch, repeats: int = 5) -> float:
    return best_ms(lambda: runner.execute(batch), runner.device, repeats, warmup=1)


def fit_overhead(sequences: list[int], residuals_ms: list[float]) -> tuple[float, float]:
    """Fit ``residual = fixed + per_sequence * sequences``, both kept >= 0.

    Least absolute deviations (iteratively reweighted least squares): a batch slowed down by
    another process is an outlier that only ever adds time, and must not drag the line up.
    """
    x = np.asarray(sequences, dtype=float)
    y = np.asarray(residuals_ms, dtype=float)
    design = np.column_stack([np.ones_like(x), x])
    weights = np.ones_like(y)
    for _ in range(30):
        root = np.sqrt(weights)
        (fixed, per_sequence), *_ = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)
        weights = 1.0 / np.maximum(np.abs(y - fixed - per_sequence * x), 1e-3)
    if per_sequence < 0:
        return max(0.0, float(np.median(y))), 0.0
    if fixed < 0:
        return 0.0, max(0.0, float(np.median(y / np.maximum(x, 1.0))))
    return float(fixed), float(per_sequence)


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    tokens: tuple[int, ...] = TOKEN_GRID
    prefill_kv: tuple[int, ...] = PREFILL_KV_GRID
    prefill_chunk: tuple[int, ...] = PREFILL_CHUNK_GRID
    decode_batch: tuple[int, ...] = DECODE_BATCH_GRID
    decode_kv: tuple[int, ...] = DECODE_KV_GRID
    calibration_batches: int = 24


def profile(model_dir: Path, device: str, out: Path, repeats: int,
            grid: ProfileGrid = ProfileGrid()) -> Path:
    model_config = ModelConfig.from_dir(model_dir)
    # Calibration batches hold up to 24 decodes of 2K tokens plus three prefill chunks.
    needed_blocks = max(2 * max(grid.decode_kv), 60_000) // BLOCK_SIZE + 64
    runner = ModelRunner(EngineConfig(model_dir=model_dir, device=device,
                                      num_kv_blocks=needed_blocks), model_config)
    profiler = Profiler(runner, repeats)
    steps = len(grid.tokens) + len(grid.prefill_kv) * len(grid.prefill_chunk) + \
        len(grid.decode_batch) * len(grid.decode_kv) + 1
    tables: dict[str, list] = {}
    with torch.inference_mode(), tqdm(total=steps, unit="point", desc="profiling") as progress:
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
        meta = ProfileMeta(num_layers=model_config.num_layers, device=str(runner.device),
                           model={"name": model_dir.name, "hidden_size": model_config.hidden_size,
                                  "num_attention_heads": model_config.num_heads,
                                  "num_key_value_heads": model_config.num_kv_heads,
                                  "intermediate_size": model_config.intermediate_size},
                           linear_profiled_max_tokens=max(grid.tokens))
        tables = {op: monotone_envelope(rows) for op, rows in tables.items()}
        write_profile(out, tables, meta)
        # The layer tables miss the work around the layers; fit it as a + b * sequences.
        predictor = RuntimePredictor.from_directory(out, cache_dir=None)
        residuals, sequences = [], []
        for batch in calibration_batches(np.random.default_rng(0), grid.calibration_batches,
                                         2048):
            residuals.append(measure_execute_ms(runner, batch) - predict_ms(predictor, batch))
            sequences.append(len(batch.chunks))
        progress.update()
    fixed_ms, per_sequence_ms = fit_overhead(sequences, residuals)
    meta = dataclasses.replace(meta, iteration_overhead_ms=fixed_ms,
                               per_sequence_overhead_ms=per_sequence_ms)
    write_profile(out, tables, meta)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="Hugging Face model directory; default: the embedded tiny model")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--out", type=Path, required=True, help="profile directory to write")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per grid point")


def run(args: argparse.Namespace) -> int:
    from slipstream.agent.engine.tiny_model import ensure_default_model

    model_dir = args.model or ensure_default_model()
    out = profile(model_dir, args.device, args.out, args.repeats)
    print(f"wrote profile of {model_dir.name} to {out}")
    return 0
