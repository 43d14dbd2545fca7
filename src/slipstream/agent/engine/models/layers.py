"""How a model file asks for its layers, so that model files stay free of sharding code.

    model file --LayerFactory--> nn.Linear / nn.Embedding          (one process, this module)
                             --> column/row/vocab-parallel layers  (tensor parallel,
                                                                    slipstream.agent.parallel)
    model file --PipelineStage--> which decoder layers this process builds and runs

A model builds every projection through ``layers`` and every decoder layer listed in
``stage``; it never looks at ranks or process groups. The only thing it asks is how many of its
attention heads live here (``local_count``), because reshapes depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


class LayerFactory(Protocol):
    def embedding(self, vocab_size: int, hidden_size: int) -> nn.Module:
        """Token ids ``[tokens]`` -> ``[tokens, hidden]``."""

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A projection whose output features may be split across ranks (no communication)."""

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """A projection whose input features may be split; its output is complete everywhere."""

    def lm_head(self, hidden_size: int, vocab_size: int) -> nn.Module:
        """``[tokens, hidden]`` -> full logits ``[tokens, vocab]`` on every rank."""

    def local_count(self, total: int) -> int:
        """How many of ``total`` attention heads (or KV heads) this process holds."""

    def expert_shard(self, num_experts: int) -> ExpertShard:
        """Which of a mixture's ``num_experts`` experts live here, and how their partial
        outputs are summed over the ranks (models/moe.py)."""


@dataclass(frozen=True)
class ExpertShard:
    """A rank's part of a mixture of experts: experts ``[first_expert, first_expert +
    num_local)`` (expert parallelism), each with ``1 / tp_size`` of its intermediate width
    (tensor parallelism). ``reduce`` sums a partial output over the ranks in place; None in
    one process."""

    first_expert: int
    num_local: int
    tp_rank: int = 0
    tp_size: int = 1
    reduce: Callable[[torch.Tensor], None] | None = None


class LocalLayers:
    """The single-process factory: plain torch layers, everything local."""

    def embedding(self, vocab_size: int, hidden_size: int) -> nn.Module:
        return nn.Embedding(vocab_size, hidden_size)

    def column_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def row_linear(self, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def lm_head(self, hidden_size: int, vocab_size: int) -> nn.Module:
        return nn.Linear(hidden_size, vocab_size, bias=False)

    def local_count(self, total: int) -> int:
        return total

    def expert_shard(self, num_experts: int) -> ExpertShard:
        return ExpertShard(0, num_experts)


@dataclass(frozen=True)
class PipelineStage:
    """The decoder layers ``[first_layer, end_layer)`` one pipeline stage owns.

    The first stage also owns the token embedding; the last owns the final norm and LM head.
    """

    first_layer: int
    end_layer: int
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, num_layers, True, True)

    @classmethod
    def split(cls, num_layers: int, num_stages: int, stage: int) -> PipelineStage:
        """Stage ``stage`` of ``num_stages`` near-equal contiguous parts (earlier ones larger)."""
        if not 0 <= stage < num_stages or num_stages > num_layers:
            raise ValueError(f"cannot make stage {stage} of {num_stages} from {num_layers} layers")
        base, extra = divmod(num_layers, num_stages)
        first = stage * base + min(stage, extra)
        end = first + base + (1 if stage < extra else 0)
        return cls(first, end, stage == 0, stage == num_stages - 1)

    @property
    def layer_indices(self) -> range:
        return range(self.first_layer, self.end_layer)
