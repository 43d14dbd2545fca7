"""Piecewise CUDA graphs for steps that mix decodes with prefill chunks: everything but
attention replays from graphs, and attention runs eagerly between them, as in vLLM.

A mixed step's shapes change with its chunks (how many sequences, how long each query, how
much KV), so its attention cannot be one static launch; but the rest of a layer works on
rows alone (norms, projections, rotary embedding, MLP), and a batch padded to a captured
token count has the same shapes every time. So for each size ``T`` of ``MIXED_SIZES``::

    graph 0       embed(ids[:T]) -> rotary angles -> layer 0 before attention
    (eager)       layer 0 attention of the step's real n <= T tokens
    graph i       layer i-1 after attention -> layer i before attention       (1 <= i < L)
    (eager)       layer i attention
    graph L       layer L-1 after attention -> final norm -> hidden [T, hidden]
    (eager)       the LM head on the rows that sample, then the sampler

Graphs and eager attention meet in static buffers sized for the largest ``T``: q, k and v
(each graph copies its output there), the attention output (copied in after each eager
call) and the residual stream (updated in place). A padded row has token 0 and computes
garbage nobody reads: attention sees only the real tokens (its metadata is the step's), and
no dense operation mixes rows. The L+1 graphs of a size cost L+1 launches instead of about
a dozen per layer, which is what a mixed step pays beyond its arithmetic.

Steps with more tokens than the largest size run eagerly: their matmuls take long enough
that the launches do not matter. Mixture-of-experts layers stay eager (their routing sizes
the expert matmuls on the host). On a CPU the same pieces run without capture, which is how
the path is tested against the eager forward without a GPU.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slipstream.agent.engine.models.llama import KVCache, LlamaDecoderLayer, LlamaForCausalLM
from slipstream.agent.engine.step.graph_capture import capture_graph
from slipstream.kernels.attention import AttentionBackend

log = logging.getLogger(__name__)

# Token counts captured: a mixed step of up to 512 tokens spends more of its time launching
# kernels than a larger one; vLLM captures up to 512 by default as well.
MIXED_SIZES = (64, 128, 256, 512)


@dataclass
class _Size:
    size: int
    # Outputs of graph 0 that later graphs read: the rotary angles of the padded positions.
    angles: dict[bool, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hidden: torch.Tensor | None = None  # graph L's output, [size, hidden]
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)


class MixedGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache],
                 device: torch.device, dtype: torch.dtype,
                 sizes: tuple[int, ...] = MIXED_SIZES) -> None:
        config = model.config
        inner = model.model
        if inner.embed_tokens is None or inner.norm is None or model.lm_head is None:
            raise ValueError("piecewise graphs run a whole model in one process")
        self.model = model
        self.layers: list[LlamaDecoderLayer] = list(inner.layers.values())  # type: ignore
        self.local_rope = inner.local_rope
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = tuple(sorted(sizes))
        self.max_size = largest = self.sizes[-1]
        attn = self.layers[0].self_attn
        heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

        def buffer(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=kind, device=device)

        self._ids = buffer(largest, kind=torch.int64)
        self._positions = buffer(largest, kind=torch.int64)
        self._query = buffer(largest, heads, dim)
        self._key = buffer(largest, kv_heads, dim)
        self._value = buffer(largest, kv_heads, dim)
        self._attended = buffer(largest, heads, dim)
        self._residual = buffer(largest, config.hidden_size)
        self._sizes = {size: _Size(size) for size in self.sizes}
        self.use_graphs = False
        self.capture_s: float | None = None
        self.runs = 0  # steps served from this path since start-up

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size holding ``num_tokens`` tokens, or None."""
        return next((size for size in self.sizes if size >= num_tokens), None)

    # -- the pieces ------------------------------------------------------------------------

    def _pieces(self, size: _Size) -> list[Callable[[], None]]:
        """The L+1 graph bodies of one size; each reads and writes only static tensors."""
        between = [functools.partial(self._between, size, index)
                   for index in range(1, len(self.layers))]
        return [functools.partial(self._first, size), *between,
                functools.partial(self._last, size)]

    def _first(self, size: _Size) -> None:
        count, inner = size.size, self.model.model
        hidden = inner.embed(self._ids[:count])
        size.angles = inner.angles(self._positions[:count], hidden.dtype)
        self._before(size, 0, hidden, None)

    def _between(self, size: _Size, index: int) -> None:
        hidden, residual = self._after(size, index - 1)
        self._before(size, index, hidden, residual)

    def _last(self, size: _Size) -> None:
        hidden, residual = self._after(size, len(self.layers) - 1)
        size.hidden = self.model.model.finish(hidden, residual)

    def _before(self, size: _Size, index: int, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> None:
        count = size.size
        cos, sin = size.angles[self.local_rope[index]]
        query, key, value, residual = self.layers[index].before_attention(
            hidden, residual, cos, sin)
        self._query[:count].copy_(query)
        self._key[:count].copy_(key)
        self._value[:count].copy_(value)
        _keep(self._residual[:count], residual)

    def _after(self, size: _Size, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        count = size.size
        residual = self._residual[:count]
        hidden, residual_out = self.layers[index].after_attention(self._attended[:count],
                                                                  residual)
        _keep(residual, residual_out)
        return hidden, residual

    # -- capture ---------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's graphs, largest first, into one pool. The warm-up runs of
        the pieces read and write the static buffers only, never the KV cache."""
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; on a CPU the pieces run "
                               "eagerly")
        started = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for count in reversed(self.sizes):
            size = self._sizes[count]
            size.graphs = [capture_graph(piece, self.device, pool)[0]
                           for piece in self._pieces(size)]
        for size in self._sizes.values():
            self.check(size, [graph.replay for graph in size.graphs])
        torch.cuda.synchronize(self.device)
        self.use_graphs = True
        self.capture_s = time.perf_counter() - started
        reserved = torch.cuda.memory_reserved(self.device) - reserved_before
        log.info("captured %d piecewise CUDA graphs for mixed steps (%d per size, token "
                 "counts %s) in %.1f s, %.2f GiB reserved",
                 sum(len(size.graphs) for size in self._sizes.values()), len(self.layers) + 1,
                 ", ".join(map(str, self.sizes)), self.capture_s, reserved / 2**30)

    @torch.inference_mode()
    def check(self, size: _Size, replays: list[Callable[[], None]]) -> None:
        """Run ``replays`` (a size's graph replays) and the same pieces eagerly on random
        tokens, with a fixed tensor standing in for every layer's attention (no KV is
        touched), and raise RuntimeError unless the final hidden states agree: a graph that
        replays wrongly turns the pieces off at start-up instead of serving bad tokens."""
        count = size.size
        generator = torch.Generator(device=self.device).manual_seed(count)
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (count,), generator=generator, device=self.device)
        positions = torch.randint(0, 4096, (count,), generator=generator, device=self.device)
        attended = torch.randn(self._attended[:count].shape, generator=generator,
                               device=self.device).to(self._attended.dtype)
        kept = size.angles, size.hidden  # the eager run rebinds them; the graphs own these

        def run(pieces: list[Callable[[], None]]) -> torch.Tensor:
            self._ids[:count].copy_(ids)
            self._positions[:count].copy_(positions)
            for piece in pieces[:-1]:
                piece()
                self._attended[:count].copy_(attended)
            pieces[-1]()
            assert size.hidden is not None
            return size.hidden.float().clone()

        try:
            replayed = run(replays)
            eager = run(self._pieces(size))
        finally:
            size.angles, size.hidden = kept
        error = float((replayed - eager).abs().max())
        if not error <= 1e-2 * max(1.0, float(eager.abs().max())):
            raise RuntimeError(f"the piecewise graphs of {count} tokens differ from the same "
                               f"pieces run eagerly by {error:.3g}")

    # -- a step ----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        """The final hidden states ``[n, hidden]`` of a step's ``n`` tokens (``backend``
        already planned with its metadata), the same as the model's forward."""
        num_tokens = input_ids.shape[0]
        count = self.size_for(num_tokens)
        if count is None:
            raise ValueError(f"{num_tokens} tokens are more than the largest piecewise size "
                             f"({self.max_size})")
        size = self._sizes[count]
        self._ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self._positions[:num_tokens].copy_(positions, non_blocking=True)
        replay: list[Callable[[], None]] = [graph.replay for graph in size.graphs] \
            if self.use_graphs else self._pieces(size)
        for index, layer in enumerate(self.layers):
            replay[index]()
            attended = layer.self_attn.attend(
                self._query[:num_tokens], self._key[:num_tokens], self._value[:num_tokens],
                self.kv_caches[index], backend)
            self._attended[:num_tokens].copy_(attended)
        replay[-1]()
        self.runs += 1
        assert size.hidden is not None
        return size.hidden[:num_tokens]


def _keep(static: torch.Tensor, value: torch.Tensor) -> None:
    """Leave ``value`` in ``static``: nothing to do where an in-place norm wrote it there."""
    if value.data_ptr() != static.data_ptr():
        static.copy_(value)
