"""Build a model from a Hugging Face directory: config.json plus *.safetensors shards.

Parameters are matched by name. Anything missing is an error that names the tensors; tensors
the model does not use (rotary caches in old checkpoints) are skipped.

Under parallelism each rank builds only its part of the model: a pipeline stage skips the
checkpoint's tensors of other stages, and a tensor-parallel layer cuts its own slice out of
the full tensor (its ``shard_tensor`` method), so the loader knows no sharding rule itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.models.layers import LayerFactory, LocalLayers, PipelineStage
from slipstream.agent.engine.models.llama import (LlamaForCausalLM, fuse_projections,
                                                  tie_word_embeddings)
from slipstream.agent.engine.models.moe import stack_expert_tensors
from slipstream.agent.engine.models.quant_kernels import install_quantized, prepare_quantized
from slipstream.agent.engine.models.registry import model_class
from slipstream.agent.engine.models.weight_formats import QuantizedWeight
from slipstream.agent.engine.models.quantization import (
    DEFAULT_GROUP_SIZE, QuantizationError, at_load_format, describe, quantize_at_load,
    read_quantized_checkpoint, resolve_quantization)

log = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and inexact
    return _DTYPES.get(config.torch_dtype, torch.bfloat16) if config.torch_dtype != "float32" \
        else torch.bfloat16


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _open_checkpoint(path: Path):
    """``safe_open`` with one clear ValueError for a file that is empty, truncated (an
    interrupted download) or not safetensors at all; safetensors checks the header's offsets
    against the file's size when it opens it."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as error:
        size = path.stat().st_size if path.exists() else 0
        raise ValueError(f"{path} ({size} bytes) is not a readable safetensors file: {error} "
                         "(truncated or still downloading? fetch it again)") from None


def check_checkpoint(model_dir: str | Path) -> None:
    """Open every shard's header (no tensor is read): what the workers of a multi-process
    instance would load, checked once before they start."""
    for path in safetensors_files(Path(model_dir)):
        with _open_checkpoint(path):
            pass


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None, layers: LayerFactory | None = None,
               stage: PipelineStage | None = None,
               load_format: str = "safetensors",
               weights: WeightSource | None = None) -> LlamaForCausalLM:
    """The model of ``model_dir`` on ``device``: its checkpoint's weights, or with
    ``load_format="dummy"`` random ones made on the device (``dummy_weights``). ``weights``
    says in which formats (``quantization.py``); by default, the checkpoint's float weights."""
    model_dir = Path(model_dir)
    weights = weights or WeightSource()
    config = config or ModelConfig.from_dir(model_dir)
    stage = stage or PipelineStage.whole(config.num_layers)
    if weights.quantized and layers is not None and not isinstance(layers, LocalLayers):
        raise QuantizationError(f"{weights.describe(model_dir)} weights run without tensor "
                                "parallelism only for now: serve them with --tp 1")
    if weights.quantized and weights.resolved != "gguf" and config.moe is not None:
        # A GGUF's experts are dequantized as they are read (gguf_weights.py says the cost).
        raise QuantizationError(f"{config.architecture}: quantized mixture-of-experts weights "
                                "are not supported yet (--quantization none)")
    with torch.device("meta"):
        family = model_class(config)
        model = family(config, layers, stage)
        # Names of the whole model, to tell another stage's tensors from unknown ones.
        whole_names = set(dict(model.named_parameters())) if stage == PipelineStage.whole(
            config.num_layers) else set(dict(family(config).named_parameters()))
    expected = dict(model.named_parameters())
    tied_apart = config.tie_word_embeddings and "lm_head.weight" in expected \
        and "model.embed_tokens.weight" not in expected  # SPP: head and embedding on two stages
    loaded: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    tensors = _checkpoint_tensors(model_dir, load_format, weights, expected, device, dtype)
    if config.moe is not None:
        tensors = stack_expert_tensors(tensors, config.moe.num_experts)
    for source, name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        target = "lm_head.weight" if tied_apart and name == "model.embed_tokens.weight" \
            else name
        if target not in expected:
            if name in whole_names:
                continue  # another pipeline stage holds it
            raise ValueError(f"{source}: unexpected tensor {name!r} for {config.architecture}")
        if not isinstance(tensor, torch.Tensor):
            if tuple(tensor.shape) != tuple(expected[target].shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"shape {tuple(expected[target].shape)}")
            quantized[target] = tensor
            continue
        tensor = _local_part(model, target, tensor)
        if tensor.shape != expected[target].shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                             f"shape {tuple(expected[target].shape)}")
        loaded[target] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings and not tied_apart:
        loaded.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    for name in quantized:
        expected.pop(name)
        expected.pop(name.removesuffix(".weight") + ".bias", None)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. "
                         f"{missing[:5]}")
    install_quantized(model, quantized, loaded, dtype)
    model.load_state_dict(loaded, strict=False, assign=True)
    tie_word_embeddings(model, config)
    # Buffers (rotary inverse frequencies) were created on the meta device; rebuild them.
    model.model.rebuild_rotary(config, device)
    fuse_projections(model)
    if quantized:
        counts = prepare_quantized(model, device, weights.activations)
        log.info("weights %s: %s", weights.describe(model_dir),
                 "; ".join(f"{count} x {name}" for name, count in sorted(counts.items())))
        release_freed_heap()
    return model.eval()


def release_freed_heap() -> None:
    """Hand the heap that loading freed back to the OS. Packing quantized weights allocates
    and frees large temporaries (unpacked values, tensor by tensor), which glibc otherwise
    keeps: on SmolLM2's Q4_1 file that was 200 MB of a server's resident memory, twice the
    weights. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


@dataclass(frozen=True)
class WeightSource:
    """In which formats the weights are served (``quantization.py``): ``resolved`` is none,
    int8, int4, fp8 (a float checkpoint quantized at load), gguf (``gguf_file``'s blocks) or
    checkpoint (a quantized Hugging Face checkpoint as stored)."""

    resolved: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE
    gguf_file: Path | None = None
    activations: str = "bf16"  # bf16 | q8 (EngineConfig.gguf_activations)

    @property
    def quantized(self) -> bool:
        return self.resolved != "none"

    def describe(self, model_dir: Path) -> str:
        text = describe(self.resolved, model_dir, self.gguf_file, self.group_size)
        return text + "+q8-activations" if self.activations == "q8" else text


def weight_source(config: EngineConfig) -> WeightSource:
    """The weight formats ``config`` asks for, resolved against its model (QuantizationError
    when they cannot be served)."""
    return WeightSource(resolve_quantization(config.quantization, config.model_dir,
                                             config.gguf_file),
                        config.quantization_group_size, config.gguf_file,
                        config.gguf_activations)


def _checkpoint_tensors(model_dir: Path, load_format: str, weights: WeightSource,
                        expected: dict[str, torch.nn.Parameter], device: torch.device,
                        dtype: torch.dtype
                        ) -> Iterator[tuple[str, str, torch.Tensor | QuantizedWeight]]:
    """(where from, name, tensor or quantized weight), one tensor at a time, so a float
    checkpoint quantized at load never has more than one float tensor in memory."""
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"load_format must be safetensors or dummy, got {load_format!r}")
    if weights.resolved == "gguf":
        from slipstream.agent.engine.models.gguf_weights import read_gguf_weights

        if weights.gguf_file is None:
            raise ValueError("gguf weights need the GGUF file")
        raw = json.loads((model_dir / "config.json").read_text())
        for name, tensor in read_gguf_weights(weights.gguf_file, raw, dtype):
            yield weights.gguf_file.name, name, tensor
        return
    if load_format == "dummy":
        for name, tensor in dummy_weights(expected, device, dtype).items():
            yield "dummy", name, quantize_at_load(name, tensor, weights.resolved,
                                                  weights.group_size)
        return
    for path in safetensors_files(model_dir):
        with _open_checkpoint(path) as shard:
            names = [name for name in shard.keys() if not name.endswith(_IGNORED_SUFFIXES)]
            if weights.resolved == "checkpoint":
                for name, tensor in read_quantized_checkpoint(model_dir, shard, names):
                    yield path.name, name, tensor
                continue
            for name in names:
                tensor = shard.get_tensor(name)
                if at_load_format(name, weights.resolved) is not None:
                    tensor = quantize_at_load(name, tensor.to(device), weights.resolved,
                                              weights.group_size)
                yield path.name, name, tensor


def dummy_weights(expected: dict[str, torch.nn.Parameter], device: torch.device,
                  dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the shapes ``expected`` names, drawn on ``device`` in ``dtype``
    (no float32 copy, no file): norms 1, embeddings std 0.02, projections std
    1/sqrt(fan_in), as ``tiny_model.random_weights`` makes them, so activations keep a
    spread of order one through any depth. The same seed and device give the same weights."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, parameter in expected.items():
        tensor = torch.empty(parameter.shape, dtype=dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        elif name.endswith("embed_tokens.weight"):
            tensor.normal_(0.0, 0.02, generator=generator)
        else:
            tensor.normal_(0.0, parameter.shape[-1] ** -0.5, generator=generator)
        weights[name] = tensor
    return weights


def _local_part(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The slice of a checkpoint tensor this rank keeps (all of it unless the layer is sharded)."""
    module_name, _, param_name = name.rpartition(".")
    owner = model.get_submodule(module_name)
    shard_tensor = getattr(owner, "shard_tensor", None)
    return shard_tensor(param_name, tensor) if shard_tensor is not None else tensor
