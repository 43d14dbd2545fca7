"""Build a model from a Hugging Face directory: config.json plus *.safetensors shards.

Parameters are matched by name. Anything missing is an error that names the tensors; tensors
the model does not use (rotary caches in old checkpoints) are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from slipstream.agent.engine.config import ModelConfig
from slipstream.agent.engine.models.llama import LlamaForCausalLM

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


def load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = config or ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    raise ValueError(f"{path.name}: unexpected tensor {name!r} for "
                                     f"{config.architecture}")
                tensor = shard.get_tensor(name)
                if tensor.shape != expected[name].shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {tuple(expected[name].shape)}")
                loaded[name] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        loaded.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. "
                         f"{missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers (rotary inverse frequencies) were created on the meta device; rebuild them.
    model.model.rotary = type(model.model.rotary)(config.head_dim, config.rope_theta,
                                                  config.rope_scaling).to(device)
    return model.eval()
