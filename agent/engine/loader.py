"""Build a model from a Hugging Face directory: config.json plus *.safetensors shards.

Parameters are matched by name. Anything missing is an error that names the tensors; tensors
the model does not use (rotary caches in old checkpoints) are skipped.

Under parallelism each rank builds only its part of the model: a pipeline stage skips the
checkpoint's tensors of other stages, and a tensor-parallel layer cuts its own slice out of
the full tensor (its ``shard_tensor`` method), so the loader knows no sharding rule itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.models.layers import LayerFactory, PipelineStage
from slipstream.agent.engine.models.llama import (LlamaForCausalLM, fuse_projections,
                                                   tie_word_embeddings)

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
               load_format: str = "safetensors") -> LlamaForCausalLM:
    """The model of ``model_dir`` on ``device``: its checkpoint's weights, or with
    ``load_format="dummy"`` random ones made on the device (``dummy_weights``)."""
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    stage = stage or PipelineStage.whole(config.num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, layers, stage)
        # Names of the whole model, to tell another stage's tensors from unknown ones.
        whole_names = set(dict(model.named_parameters())) if stage == PipelineStage.whole(
            config.num_layers) else set(dict(LlamaForCausalLM(config).named_parameters()))
    expected = dict(model.named_parameters())
    tied_apart = config.tie_word_embeddings and "lm_head.weight" in expected \
        and "model.embed_tokens.weight" not in expected  # SPP: head and embedding on two stages
    loaded: dict[str, torch.Tensor] = {}
    if load_format == "dummy":
        loaded = dummy_weights(expected, device, dtype)
    elif load_format != "safetensors":
        raise ValueError(f"load_format must be safetensors or dummy, got {load_format!r}")
    for path in safetensors_files(model_dir) if load_format == "safetensors" else ():
        with _open_checkpoint(path) as shard:
            for name in shard.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                target = "lm_head.weight" if tied_apart and name == "model.embed_tokens.weight" \
                    else name
                if target not in expected:
                    if name in whole_names:
                        continue  # another pipeline stage holds it
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for "
                                     f"{config.architecture}")
                tensor = _local_part(model, target, shard.get_tensor(name))
                if tensor.shape != expected[target].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {tuple(expected[target].shape)}")
                loaded[target] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings and not tied_apart:
        loaded.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. "
                         f"{missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    tie_word_embeddings(model, config)
    # Buffers (rotary inverse frequencies) were created on the meta device; rebuild them.
    model.model.rotary = type(model.model.rotary)(config.head_dim, config.rope_theta,
                                                  config.rope_scaling).to(device)
    fuse_projections(model)
    return model.eval()


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
