"""The grids ``slipstream profile`` measures on (profiler.py): token counts for the linear
ops, (KV before, chunk) for prefill attention, (batch, KV total) for decode attention, and the
calibration load; one named grid per use (``--grid``).
"""

from __future__ import annotations

import dataclasses

from slipstream.agent.engine.profile.step_calibration import CalibrationLoad

TOKEN_GRID = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_KV_GRID = (0, 256, 512, 1024, 2048, 4096)
PREFILL_CHUNK_GRID = (32, 64, 128, 256, 512, 1024)
DECODE_BATCH_GRID = (1, 2, 4, 8, 16, 32, 64)
DECODE_KV_GRID = (256, 1024, 4096, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    tokens: tuple[int, ...] = TOKEN_GRID
    prefill_kv: tuple[int, ...] = PREFILL_KV_GRID
    prefill_chunk: tuple[int, ...] = PREFILL_CHUNK_GRID
    decode_batch: tuple[int, ...] = DECODE_BATCH_GRID
    decode_kv: tuple[int, ...] = DECODE_KV_GRID
    calibration_batches: int = 24  # random ModelRunner batches for the runner overhead
    calibration_repeats: int = 5
    engine_load: CalibrationLoad = CalibrationLoad()  # engine steps for the host overhead
    max_point_ms: float | None = None  # stop repeating a grid point after this long (best_ms)


# "small" keeps profiling a ~100M-parameter model on a 2-core CPU to a few minutes: fewer
# grid points (the predictor interpolates between them) and lighter calibration.
PROFILE_GRIDS = {
    "full": ProfileGrid(),
    "small": ProfileGrid(tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
                         prefill_kv=(0, 512, 2048, 4096), prefill_chunk=(32, 128, 512, 1024),
                         decode_batch=(1, 4, 16, 64), decode_kv=(256, 2048, 16384),
                         calibration_batches=16, calibration_repeats=3,
                         engine_load=CalibrationLoad(waves=(1, 4, 12, 24),
                                                     prompt_tokens=(16, 200))),
    # "quick" is what `slipstream serve` measures on its first start (auto_profile.py): what the
    # time-budget packer needs, as fast as possible. Three points per attention axis (the
    # predictor interpolates between them and extrapolates past the last), linear ops up to
    # 512 tokens (beyond, linear in tokens: a 512-token GEMM is compute-bound already), a slow
    # point timed once after one warm-up, and a lighter calibration. Its engine load still
    # reaches 32 concurrent requests: with waves of at most 12, the per-sequence overhead was
    # extrapolated from small batches (SmolLM2 on 2 CPU cores: 7.7 ms per sequence fitted,
    # about 1 ms measured at 32 decodes), and the packer split batches of 32 decodes.
    "quick": ProfileGrid(tokens=(1, 8, 32, 128, 512),
                         prefill_kv=(0, 1024, 4096), prefill_chunk=(32, 128, 512),
                         decode_batch=(1, 8, 64), decode_kv=(256, 2048, 16384),
                         calibration_batches=4, calibration_repeats=1,
                         engine_load=CalibrationLoad(waves=(1, 4, 12, 32),
                                                     prompt_tokens=(16, 160),
                                                     output_tokens=(8, 24)),
                         max_point_ms=200.0),
    # "quick-gpu" is the first start's grid on CUDA: the same calibration, with the attention
    # tables reaching the contexts a GPU serves (64K-token prefixes and decode KV)
    # and prefill chunks of 2K tokens, each point a few milliseconds there. Beyond a table the
    # predictor extrapolates linearly in attended pairs from its last point, where launch
    # overhead still dominates on a GPU: from 4K it predicted a 64K prefix far too slow, the
    # packer cut the prompt into tiny chunks, and a 64K prompt alone took 103 s (H200).
    "quick-gpu": ProfileGrid(tokens=(1, 8, 32, 128, 512, 2048),
                             prefill_kv=(0, 4096, 32768, 65536),
                             prefill_chunk=(32, 256, 2048),
                             decode_batch=(1, 8, 64, 256), decode_kv=(256, 16384, 65536),
                             calibration_batches=4, calibration_repeats=1,
                             engine_load=CalibrationLoad(waves=(1, 4, 12, 32),
                                                         prompt_tokens=(16, 160),
                                                         output_tokens=(8, 24)),
                             max_point_ms=200.0),
}
