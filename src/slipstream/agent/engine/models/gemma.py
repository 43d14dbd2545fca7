"""Gemma 2 and Gemma 3 (text): the decoder of ``llama.py`` with Gemma's options, in the same
reading order.

    model          token embedding times sqrt(hidden_size) (rounded to the dtype, as
                   transformers does); final norm; LM head tied to the embedding; final
                   logits soft-capped, ``cap * tanh(logits / cap)`` (Gemma 2's 30; Gemma 3
                   only when its config sets one)
    decoder layer  "sandwich" norms: input_layernorm -> attention -> post_attention_layernorm,
                   added to the stream; pre_feedforward_layernorm -> MLP ->
                   post_feedforward_layernorm, added to the stream
    attention      scale ``query_pre_attn_scalar ** -0.5`` (not head_dim's); layers alternate
                   between a sliding window (keys within ``sliding_window`` tokens of the
                   query, the query's own included) and global attention: Gemma 2 every other
                   layer, Gemma 3 five sliding to one global (``layer_types``).
                   Gemma 2: scores soft-capped (``attn_logit_softcapping``, 50) in the
                   attention backend. Gemma 3: QK-norm as Qwen3, and the sliding layers'
                   RoPE base is ``rope_local_base_freq`` (10,000), unscaled
    MLP            gate/up/down with gelu (tanh approximation) in place of SiLU
    norm           RMSNorm scaling by ``1 + weight`` (weights stored around zero), in fp32

ModelConfig.from_dict (``family_options``) sets these from config.json; these classes only
name the families for the registry.
"""

from __future__ import annotations

from slipstream.agent.engine.models.llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's module tree plus ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` per layer, the checkpoint's names."""


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 2's tree plus ``self_attn.q_norm`` and ``self_attn.k_norm``."""
