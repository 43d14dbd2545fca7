"""The runtime profile a server makes for itself on its first start, so the time-budget packer
is on by default.

    slipstream serve (no --profile, no --no-profile)
        --> ProfileKey(model files, dtype, device, threads, engine version)
        --> <cache>/runtime-profiles/<model>-<device>-<dtype>-<hash>/
              key.json matches and the tables load?  yes --> use it (no profiling)
                                                     no  --> one-line warning if it was there
                                                             (stale or corrupt), then
                                                             `slipstream profile --grid quick`
                                                             into <entry>.partial, renamed into place

The entry's name holds a hash of the model's path, the device, the dtype and the thread count,
so each of those gets its own entry. ``key.json`` holds the whole key: an entry made by another
engine version, or from model files that changed since, is stale and measured again in place. An
entry that no longer loads (a truncated table, a missing file) is corrupt and measured again.
A lock file serializes servers that start together on one machine: the second waits for the
first one's profile and reads it.

Bump ``PROFILER_VERSION`` when the profiler, the kernels or the engine's step change what a
step costs, so cached profiles are measured again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from slipstream import __version__
from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.models.loader import resolve_dtype, weight_source
from slipstream.agent.engine.step.model_runner import resolve_device
from slipstream.agent.engine.models.cpu_matmul import resolve_cpu_matmul
from slipstream.kernels import cpp_build, cpu_quant_gemm
from slipstream.kernels.attention import backend_name

log = logging.getLogger(__name__)

# 2: random calibration batches no longer outweigh the engine steps
# 3: on CUDA the engine calibration runs its load once untimed first
# 4: fused q/k/v and gate/up matmuls, block-wise decode KV gathers, a cheaper finiteness check
#    in the sampler, and a 32-request wave in the quick grid's engine calibration
# 5: CPU matmuls from oneDNN-reordered weights (--cpu-matmul; its choice is part of the key)
# 6: the attention backend is part of the key (Triton on CUDA without FlashInfer), decode
#    steps from CUDA graphs, one copy of a step's inputs
# 7: the weight format is part of the key (quantized projections, docs/quantization.md)
# 8: greedy calibration requests, a warm-up run before two timed ones (each step's fastest)
#    on every device, and CPU steps that reuse their freed temporaries (step/cpu_heap.py): the
#    fitted per-sequence overhead no longer holds temperature draws, first-shape costs, page
#    faults and other processes' time; the runner's fit has a term per prefill token
# 9: quantized CPU layers on Slipstream's AVX-512 kernels (about 2x ATen's int4 kernel with BF16)
#    and compiled decodes that attend short contexts without SDPA
# 10: on CUDA, steps that mix prefills with decodes (up to 512 tokens) replay piecewise
#     graphs (step/mixed_graphs.py); prefill tiles past their chunk skip the KV
# 11: CPUs with AVX-512 but no BF16 run Slipstream's quantized kernels too (float32
#     multiply-adds), where they ran ATen's; a forced kernel choice is part of the key
# 12: CPUs with AMX multiply quantized layers with tdpbf16ps (several times vdpbf16ps from
#     8 rows up)
PROFILER_VERSION = "12"
GRID = "quick"
GPU_GRID = "quick-gpu"


def default_grid(device: torch.device) -> str:
    """The first start's grid: "quick", with long contexts on a GPU ("quick-gpu"), where
    a 64K-token prefix takes milliseconds to profile and extrapolating to it from 4K misled
    the packer into tiny chunks (a 64K prompt alone took 103 s to its first token on an H200)."""
    return GPU_GRID if device.type == "cuda" else GRID
REPEATS = 3
KEY_FILE = "key.json"


@dataclasses.dataclass(frozen=True)
class ProfileKey:
    """What a profile's timings depend on."""

    model: str  # the model directory, resolved
    model_files: str  # hash of config.json and the weight files' names, sizes and times
    dtype: str  # resolved: float32, bfloat16, float16
    device: str  # cpu or cuda, with the processor's or GPU's name
    threads: int  # torch CPU threads the engine runs with
    engine_version: str  # slipstream, profiler and torch versions, and the grid
    weights: str = "dense"  # the weight format served: dense, int8, int4-g64, gguf:F32+Q4_1...

    def entry_name(self, model_name: str) -> str:
        """Named by where the profile applies (model, device, dtype, threads), so a profile
        that a new engine version or changed model files made stale is replaced in place."""
        identity = [self.model, self.dtype, self.device, self.threads]
        if self.weights != "dense":  # dense entries keep the names they had
            identity.append(self.weights)
        digest = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:12]
        return f"{model_name}-{self.device.split(':')[0]}-{self.dtype}-{digest}"


def profile_key(model_dir: Path, dtype: str, device: str, threads: int,
                grid: str = GRID, cpu_matmul: str = "auto",
                attention_backend: str = "auto",
                served: EngineConfig | None = None) -> ProfileKey:
    """``served``: the config to be served, whose weight format (and GGUF file) the key
    names, so that the packer predicts the model actually served."""
    model_config = ModelConfig.from_dir(model_dir)
    weights = weight_source(served).describe(model_dir) if served is not None else "dense"
    gguf_file = served.gguf_file if served is not None and weights != "dense" else None
    torch_device = resolve_device(device)
    resolved = resolve_dtype(dtype, model_config, torch_device)
    matmul = resolve_cpu_matmul(cpu_matmul, torch_device, resolved)
    attention = backend_name(torch_device, attention_backend)
    # the kernel a CPU gets by itself follows from its device name; a forced one is keyed
    kernel_choice = os.environ.get(cpu_quant_gemm.DISABLE_ENV, "")
    return ProfileKey(model=str(model_dir.resolve()),
                      model_files=_model_files_hash(model_dir, gguf_file),
                      dtype=str(resolved).removeprefix("torch."),
                      device=_device_name(torch_device), threads=threads,
                      engine_version=f"slipstream {__version__}, profiler {PROFILER_VERSION}, "
                                     f"torch {torch.__version__}, grid {grid}"
                                     + (", cpu matmul onednn" if matmul == "onednn" else "")
                                     + f", attention {attention}"
                                     + (f", cpu quant kernel {kernel_choice}"
                                        if kernel_choice in ("aten", "avx512f")
                                        and weights != "dense" else ""),
                      weights=weights)


def _model_files_hash(model_dir: Path, gguf_file: Path | None = None) -> str:
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors")),
             *sorted(model_dir.glob("*.bin")), *([gguf_file] if gguf_file else [])]
    facts = [(path.name, path.stat().st_size, path.stat().st_mtime_ns)
             for path in files if path.is_file()]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{cpp_build.cpu_model()} x{os.cpu_count()}"


def cache_root() -> Path:
    from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir

    return slipstream_cache_dir() / "runtime-profiles"


def entry_problem(entry: Path, key: ProfileKey) -> str | None:
    """Why the cached profile at ``entry`` cannot be used for ``key`` (None: it can)."""
    from slipstream.agent.scheduler.predictor import RuntimePredictor

    if not entry.exists():
        return "missing"
    try:
        stored = json.loads((entry / KEY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"corrupt ({KEY_FILE}: {error})"
    if stored != dataclasses.asdict(key):
        changed = sorted(name for name, value in dataclasses.asdict(key).items()
                         if stored.get(name) != value)
        return f"stale ({', '.join(changed)} changed)"
    try:
        RuntimePredictor.from_directory(entry, cache_dir=None)
    except Exception as error:  # noqa: BLE001 - any load failure means: measure again
        return f"corrupt ({type(error).__name__}: {error})"
    return None


def with_runtime_profile(config: EngineConfig, threads: int | None = None) -> EngineConfig:
    """``config`` with the cached (or freshly measured) profile as its ``profile_dir`` when it
    asks for one (``auto_profile``) and has none; unchanged otherwise. Called in the process
    that runs the engine, before the engine is built; ``threads``: the torch threads its steps
    will run with (default: the current count)."""
    if not config.auto_profile or config.profile_dir is not None:
        return config
    budget = f"each iteration packs up to {config.scheduler.max_batched_tokens} tokens"
    if not config.parallel.is_single_process:
        log.warning("no runtime profile: the automatic one covers one device, not tp x spp x "
                    "kvp = %d ranks; %s (pass --profile for the time-budget packer)",
                    config.parallel.world_size, budget)
        return config
    try:
        entry = ensure_profile(config.model_dir, config.dtype, config.device, threads,
                               cpu_matmul=config.cpu_matmul, served=config)
    except (OSError, RuntimeError, ValueError) as error:
        log.warning("profiling failed (%s: %s); %s", type(error).__name__, error, budget)
        return config
    return dataclasses.replace(config, profile_dir=entry)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_profile(model_dir: Path, dtype: str = "auto", device: str = "auto",
                   threads: int | None = None, root: Path | None = None,
                   grid: str | None = None, cpu_matmul: str = "auto",
                   served: EngineConfig | None = None) -> Path:
    """The cached profile of ``model_dir`` on this device, measured first if there is none
    (or only a stale or corrupt one). ``served``: the engine config that will be served,
    whose attention backend, CUDA graphs and weight source the profile measures with."""
    from slipstream.agent.engine.profile.profiler import PROFILE_GRIDS, profile

    grid = grid or default_grid(resolve_device(device))
    threads = threads or torch.get_num_threads()
    key = profile_key(model_dir, dtype, device, threads, grid, cpu_matmul,
                      served.attention_backend if served is not None else "auto", served)
    root = root or cache_root()
    entry = root / key.entry_name(model_dir.name)
    with _locked(root / f"{entry.name}.lock"):
        problem = entry_problem(entry, key)
        if problem is None:
            log.info("runtime profile: %s (cached; the time-budget packer is on)", entry)
            return entry
        if problem != "missing":
            log.warning("ignoring the cached runtime profile %s: %s; profiling again", entry,
                        problem)
        log.info("first start of %s on this device (%s, %s, %d threads): profiling the engine "
                 "for the time-budget packer, once, into %s. It takes about a minute for a 135M "
                 "model on an idle 2-core CPU, longer and wrong on a busy machine; "
                 "--no-profile skips it, --profile DIR uses one you made",
                 model_dir.name, key.device, key.dtype, threads, root)
        staging = entry.with_name(entry.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        started = time.monotonic()
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            profile(model_dir, device, staging, REPEATS, PROFILE_GRIDS[grid], dtype=dtype,
                    cpu_matmul=cpu_matmul, served=served)
        finally:
            torch.set_num_threads(previous_threads)
        (staging / KEY_FILE).write_text(json.dumps(dataclasses.asdict(key), indent=1) + "\n",
                                        encoding="utf-8")
        shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
        log.info("profiled %s in %.0f s; cached at %s", model_dir.name,
                 time.monotonic() - started, entry)
    return entry
