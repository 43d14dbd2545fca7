"""Compiled CPU decode steps (``EngineConfig.cpu_compile``): whether this engine can run
them, and the decode programs compiled at start-up (``decode_graphs.py``, ``compile_cpu``)."""

from __future__ import annotations

import logging
import os

import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.models.llama import KVCache, LlamaForCausalLM
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.agent.engine.step.decode_graphs import DecodeGraphs
from slipstream.kernels import cpu_static_decode

log = logging.getLogger(__name__)

# Compiled CPU decode programs: one per batch size (EngineConfig.cpu_compile_sizes, default
# 1 and 2), compiled at start-up (about 5 s each from inductor's cache, 15-40 s without, for
# the default model on two cores). Larger batches were bound by their matmuls, where the
# operators around them matter less; with AMX's quantized matmuls (kernels/cpu_quant_gemm.cpp)
# a step of 8 sequences gains 1.25x from a program of its own, 4 sequences 1.42x.
CPU_COMPILE_SIZES = (1, 2)


def cpu_compile_sizes(max_num_seqs: int,
                      sizes: tuple[int, ...] = CPU_COMPILE_SIZES) -> tuple[int, ...]:
    """``sizes`` up to ``max_num_seqs`` (which closes the list when it is smaller)."""
    largest = min(max_num_seqs, sizes[-1])
    return tuple(size for size in sizes if size < largest) + (largest,)


def cpu_compile_refusal(config: EngineConfig, model_config: ModelConfig,
                        backend_name: str, cpu_matmul: str = "torch") -> str | None:
    """Why compiled CPU decodes cannot serve this engine, or None when they can.
    ``cpu_matmul``: the path the loaded model's float matmuls run on (apply_cpu_matmul)."""
    if not config.parallel.is_single_process:
        return "they run in a single process (no --tp/--spp/--kvp)"
    if config.disagg.enabled:
        return f"--role {config.disagg.role} steps are not compiled"
    if model_config.moe is not None:
        return "mixture-of-experts layers size their matmuls from the routing"
    if model_config.attn_logit_softcap is not None or model_config.final_logit_softcap is not None \
            or any(model_config.sliding_window_of(layer) is not None
                   for layer in range(model_config.num_layers)):
        return "sliding-window and soft-capped attention are not in the compiled kernel"
    if backend_name != "torch":
        return f"the {backend_name} attention backend runs its own kernels"
    if config.gguf_activations != "bf16":
        return "llama.cpp's 8-bit activation emulation is a measurement path"
    if cpu_matmul == "onednn":
        return ("float weights reordered for oneDNN cannot be compiled (--cpu-matmul torch "
                "allows it)")
    return None



def make_cpu_compiled_decodes(config: EngineConfig, model_config: ModelConfig,
                              backend_name: str, cpu_matmul: str, model: LlamaForCausalLM,
                              kv_caches: list[KVCache], device: torch.device
                              ) -> DecodeGraphs | None:
    """Decode steps of up to ``CPU_COMPILE_SIZES`` rows from inductor-compiled programs
    (decode_graphs.py). ``cpu_compile`` None asks for them where they pay (weights
    served quantized, where the matmuls are short and the operators around them are
    most of a step); a model they cannot run, or a failed compile, keeps decodes eager,
    with a log line that says why. True makes either an error."""
    wanted = config.cpu_compile
    reason = cpu_compile_refusal(config, model_config, backend_name,
                                 cpu_matmul)
    if reason is None and wanted is None and not config.serves_quantized_weights:
        reason = ("the weights are float (compiled decodes are on by default for "
                  "quantized weights; --cpu-compile turns them on)")
    if reason is not None:
        if wanted:
            raise ValueError(f"--cpu-compile: {reason}")
        log.info("CPU decodes run eagerly: %s", reason)
        return None
    graphs = DecodeGraphs(
        model, kv_caches, config.scheduler.max_num_seqs,
        config.max_model_len or model_config.max_position_embeddings,
        model_config.num_kv_heads, device,
        sizes=cpu_compile_sizes(config.scheduler.max_num_seqs, config.cpu_compile_sizes),
        cpu_attention=True)
    # Inductor's compiled code beside Slipstream's other generated files (a restart then
    # loads it: 6 s for the default model's two programs, 28 s compiled afresh).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(slipstream_cache_dir() / "inductor"))
    # The attention operator's C++ kernel (the Python one if it does not build).
    cpu_static_decode.use_implementation(slipstream_cache_dir() / "cpp" / "decode_attention")
    try:
        graphs.compile_cpu()
    except Exception as error:  # inductor: no C++ compiler, an op it cannot lower, ...
        if wanted:
            raise
        log.warning("compiling CPU decode steps failed (%s: %s); decodes run eagerly "
                    "(--no-cpu-compile silences this)", type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "")
        return None
    return graphs


def attend_eager_decodes_natively(graphs: DecodeGraphs | None, backend: object) -> None:
    """Compiling built the C++ decode attention kernel, so the eager steps' decodes (more rows
    than the compiled sizes, or beside prefill chunks) attend in it too
    (``TorchReferenceBackend.direct_decodes``). Engines that did not compile keep SDPA."""
    from slipstream.kernels.torch_ref import TorchReferenceBackend

    if (graphs is not None and graphs.compile_s is not None
            and isinstance(backend, TorchReferenceBackend) and cpu_static_decode.native_loaded()):
        backend.direct_decodes = True
