"""Qwen3 (dense): the Llama decoder of ``llama.py`` with QK-norm, in the same reading order.

    model          token embedding, decoder layers, final RMSNorm, LM head (tied in the small
                   sizes); RoPE as Llama's (rope_theta, optional scaling)
    decoder layer  pre-norm attention, pre-norm MLP, as Llama
    attention      q/k/v without biases (Qwen2 had them); then ``q_norm`` and ``k_norm``, an
                   RMSNorm over each head's ``head_dim``, before the rotary embedding;
                   layers from ``max_window_layers`` on slide when ``use_sliding_window``
    MLP, norm      Llama's (SiLU-gated; RMSNorm scaling by its weight)

ModelConfig.from_dict sets ``qk_norm`` for ``model_type == "qwen3"``; this class only names
the family for the registry and for start-up logs.
"""

from __future__ import annotations

from slipstream.agent.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's module tree with ``self_attn.q_norm`` and ``self_attn.k_norm`` per layer, the
    checkpoint's names."""
