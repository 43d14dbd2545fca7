"""Decode steps replayed from CUDA graphs: a step made only of decodes costs one graph launch,
one copy in and one copy out, whatever the model's depth.

    ModelRunner.execute(batch of n decodes, n <= the largest captured size)
      -> load(): ids, positions, KV slots, seq_info rows and the flattened block tables of the
                 n rows, padded to the captured size b >= n, written into one pinned staging
                 buffer -> one copy into the graphs' static input buffer
      -> replay(): embedding, every layer (Triton decode attention reading the static
                 seq_info and block indices), final norm, LM head, then the sampler's common
                 path: the greedy token and a finite-logits flag per row
      -> greedy(): one copy of [n, 2] (token, finite) back to the host
         logits(): the graph's logits [n, vocab] for the eager sampler, when a row samples
                   with temperature, penalties, logprobs or a grammar

The static input buffer (int64) is laid out for the largest size ``B``::

    [ ids (B) | positions (B) | slots (B) | seq_info (B x 6) | block indices (B x blocks/seq) ]

and the graph of size ``b`` reads the first ``b`` rows of each part; block indices are read at
each row's offset, so only the ones in use are copied. A padded row has token 0, position 0,
slot -1 (writes nothing) and no KV (attention output 0): it computes garbage nobody reads.

Sizes follow vLLM's: 1, 2, 4, 8, 16, 32, then every 16 up to ``max_num_seqs``. Graphs are
captured largest first into one memory pool, after warm-up runs that compile the kernels. On
a CPU the same static path runs eagerly (``capture=False``), which is how its bookkeeping is
tested without a GPU.

**Compiled on a CPU** (``EngineConfig.cpu_compile``, ``compile_cpu()``): the CPU has no graph
to replay, but the same static program can be compiled once per size by inductor (through
``torch.compile``), which fuses the norms, rotary embedding, residual adds and dtype casts
around the matmuls into a few C++ loops. The compiled callable is then called with the same
tensors every step, the way a graph is replayed: no Dynamo guard evaluation (about 1 ms a call
for a 30-layer model's hundreds of parameters). What a guard would check cannot change here:
every input is a parameter or a view of the static input buffer, with the same shapes for the
program's whole life. Attention runs as one opaque operator that reads the rows from those
buffers and reaches the KV cache outside the graph (``kernels/cpu_static_decode.py``). On the
default model one decode step went from 10.0 to 6.2 ms (docs/engine.md). The program calls
its kernels from inductor's C++ wrapper (``CPU_WRAPPER_ENV``), not from Python.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from slipstream.agent.engine.step.graph_capture import capture_graph
from slipstream.agent.engine.models.llama import KVCache, LlamaForCausalLM
from slipstream.agent.engine.sampling.sampler import plain_greedy
from slipstream.agent.scheduler.batch import ScheduledChunk
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.kernels.attention import SEQ_INFO_COLUMNS
from slipstream.kernels.cpu_static_decode import CpuStaticDecodeAttention, kv_caches_in_use

if TYPE_CHECKING:  # Triton is imported only once decode graphs are built (CUDA, or tests)
    from slipstream.kernels.triton_backend import StaticDecodeAttention

log = logging.getLogger(__name__)

# How inductor's program calls its kernels on a CPU. "cpp": a C++ wrapper, compiled with the
# program (inductor's cpp_wrapper, built apart from the kernels so it compiles in seconds);
# "python": inductor's default Python wrapper, which pays a Python call and an allocation per
# kernel and operator, about 270 a step for the default model's 30 layers. If the C++ wrapper
# fails to build, compile_cpu() warns and compiles the Python one.
CPU_WRAPPER_ENV = "SLIPSTREAM_CPU_COMPILE_WRAPPER"
CPU_WRAPPERS = ("cpp", "python")


def cpu_wrapper() -> str:
    """The wrapper ``CPU_WRAPPER_ENV`` asks for (default "cpp")."""
    value = os.environ.get(CPU_WRAPPER_ENV, "cpp")
    if value not in CPU_WRAPPERS:
        raise ValueError(f"{CPU_WRAPPER_ENV}={value!r}: use one of {', '.join(CPU_WRAPPERS)}")
    return value



def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, then every 16, up to ``max_num_seqs`` (always included)."""
    sizes = [size for size in (1, 2, 4, 8, 16, 32) if size < max_num_seqs]
    sizes += list(range(48, max_num_seqs, 16))
    return tuple(sizes) + (max_num_seqs,)


def graph_friendly(chunks: Sequence[ScheduledChunk]) -> bool:
    """Whether a batch is decodes only: one sampled token per row, each after a prefix."""
    return all(chunk.num_tokens == 1 and chunk.sample and chunk.start_pos > 0
               for chunk in chunks)


def greedy_only(chunks: Sequence[ScheduledChunk]) -> bool:
    """Whether the graph's own sampling (argmax) is what every row asks for."""
    return all(plain_greedy(chunk.sampling) for chunk in chunks)


@dataclass
class _Program:
    size: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    attention: StaticDecodeAttention | CpuStaticDecodeAttention
    graph: torch.cuda.CUDAGraph | None = None
    # compile_cpu(): inductor's callable and the tensors it is called with, every step.
    compiled: Callable[..., Sequence[torch.Tensor]] | None = None
    compiled_inputs: tuple[torch.Tensor, ...] = ()
    logits: torch.Tensor | None = None  # [size, vocab] float32, rewritten by each run
    result: torch.Tensor | None = None  # [size, 2] int64: greedy token, logits finite


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: list[KVCache], max_num_seqs: int,
                 max_model_len: int, num_kv_heads: int, device: torch.device,
                 sizes: Sequence[int] | None = None, cpu_attention: bool = False) -> None:
        """``sizes``: the batch sizes to build (default ``capture_sizes``). ``cpu_attention``:
        the programs attend with ``CpuStaticDecodeAttention`` (for ``compile_cpu``) instead
        of the Triton decode kernel."""
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.cpu_attention = cpu_attention
        self.sizes = tuple(sizes) if sizes is not None else capture_sizes(max_num_seqs)
        self.max_size = largest = self.sizes[-1]
        self.blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
        # Offsets of the parts of the static input buffer (module docstring).
        self._seq_info_at = 3 * largest
        self._blocks_at = self._seq_info_at + SEQ_INFO_COLUMNS * largest
        total = self._blocks_at + largest * self.blocks_per_seq
        self._inputs = torch.zeros(total, dtype=torch.int64, device=device)
        self._staging = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host = self._staging.numpy()
        self._result_host = torch.zeros(largest, 2, dtype=torch.int64,
                                        pin_memory=device.type == "cuda")
        self._pad_rows(0, largest)  # warm-up and capture run on padding alone
        self._inputs.copy_(self._staging)
        self._programs = {size: self._program(size, num_kv_heads, max_model_len)
                          for size in self.sizes}
        self.use_graphs = False
        self.capture_s: float | None = None
        self.compile_s: float | None = None  # compile_cpu()'s wall time
        self.cpu_wrapper: str | None = None  # compile_cpu()'s wrapper, one of CPU_WRAPPERS
        self.runs = 0  # steps served from this path since start-up

    def _program(self, size: int, num_kv_heads: int, max_model_len: int) -> _Program:
        from slipstream.kernels.triton_attention import decode_segments
        from slipstream.kernels.triton_backend import StaticDecodeAttention

        inputs, largest = self._inputs, self.max_size
        seq_info = inputs[self._seq_info_at:self._blocks_at].view(largest, SEQ_INFO_COLUMNS)
        if self.cpu_attention:
            return _Program(size, inputs[:size], inputs[largest:largest + size],
                            CpuStaticDecodeAttention(
                                self.kv_caches, slot_mapping=inputs[2 * largest:2 * largest + size],
                                seq_info=seq_info[:size],
                                block_indices=inputs[self._blocks_at:]))
        attention = StaticDecodeAttention(
            slot_mapping=inputs[2 * largest:2 * largest + size], seq_info=seq_info[:size],
            block_indices=inputs[self._blocks_at:],
            num_segments=decode_segments(size, num_kv_heads, max_model_len))
        return _Program(size, inputs[:size], inputs[largest:largest + size], attention)

    def size_for(self, num_rows: int) -> int | None:
        """The smallest captured size holding ``num_rows`` rows, or None."""
        return next((size for size in self.sizes if size >= num_rows), None)

    # -- capture -------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device; on a CPU the static decode "
                               "path runs eagerly")
        started = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            program = self._programs[size]
            program.graph, _ = capture_graph(functools.partial(self._forward, program),
                                             self.device, pool)
        torch.cuda.synchronize(self.device)
        self.use_graphs = True
        self.capture_s = time.perf_counter() - started
        reserved = torch.cuda.memory_reserved(self.device) - reserved_before
        log.info("captured %d CUDA graphs for decode steps (batch sizes %s) in %.1f s, "
                 "%.2f GiB reserved", len(self.sizes), _describe(self.sizes), self.capture_s,
                 reserved / 2**30)

    @torch.inference_mode()
    def compile_cpu(self) -> None:
        """Compile every program with inductor (module docstring), smallest first, and keep
        each one's callable and inputs. Raises what inductor raises (no C++ compiler, an
        operator it cannot lower); the caller decides whether decodes then stay eager."""
        if not self.cpu_attention:
            raise RuntimeError("compile_cpu() needs programs built with cpu_attention=True")
        started = time.perf_counter()
        wrapper = cpu_wrapper()
        log.info("compiling CPU decode programs for batch sizes %s with torch.compile "
                 "(--no-cpu-compile skips it): about 30 s a size the first time for a 135M "
                 "model on two cores, seconds once inductor's cache has them",
                 _describe(self.sizes))
        for size in self.sizes:
            try:
                self._compile_cpu_program(size, wrapper)
            except Exception as error:  # noqa: BLE001 - the Python wrapper is tried next
                if wrapper != "cpp":
                    raise
                # torch.compile wraps what the backend raised (BackendCompilerFailed).
                cause: BaseException = error
                while isinstance(getattr(cause, "inner_exception", None), BaseException):
                    cause = cause.inner_exception  # type: ignore[attr-defined]
                log.warning("inductor's C++ wrapper failed for the size-%d decode program "
                            "(%s: %s); compiling with its Python wrapper, about 1 ms a step "
                            "slower (%s=python skips the C++ one)", size, type(cause).__name__,
                            str(cause).splitlines()[0] if str(cause) else "", CPU_WRAPPER_ENV)
                wrapper = "python"
                self._compile_cpu_program(size, wrapper)
        self.cpu_wrapper = wrapper
        torch._dynamo.reset()  # the programs are called directly from now on
        self.compile_s = time.perf_counter() - started
        log.info("compiled %d CPU decode programs (batch sizes %s, inductor's %s wrapper) in "
                 "%.1f s", len(self.sizes), _describe(self.sizes), wrapper, self.compile_s)

    def _compile_cpu_program(self, size: int, wrapper: str) -> None:
        """Compile the size-``size`` program with inductor and the given wrapper, check it
        against an eager run and keep its callable and inputs."""
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        program = self._programs[size]
        captured: list[tuple[Callable[..., Sequence[torch.Tensor]], list[object]]] = []

        def keep(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                 ) -> Callable[..., Sequence[torch.Tensor]]:
            # The size and alignment checks of every input and operator result cost a
            # Python call each, a few hundred per step; the shapes here never change.
            # The C++ wrapper (CPU_WRAPPER_ENV) is compiled apart from the kernels: one file
            # with both took about 40 s more per size for the default model, for no faster
            # step.
            with inductor_config.patch(size_asserts=False, alignment_asserts=False,
                                       scalar_asserts=False, cpp_wrapper=wrapper == "cpp",
                                       cpp_wrapper_build_separate=True):
                compiled = cast(Callable[..., Sequence[torch.Tensor]],
                                compile_fx(graph, example_inputs))
            captured.append((compiled, list(example_inputs)))
            return compiled

        traced = torch.compile(functools.partial(self._compute, program), backend=keep,
                               fullgraph=True, dynamic=False)
        with kv_caches_in_use(self.kv_caches):
            eager = self._compute(program)
            traced()
        if len(captured) != 1:
            raise RuntimeError(f"compiling the size-{size} decode program gave "
                               f"{len(captured)} graphs, not one")
        compiled, inputs = captured[0]
        # Parameters and views of the static buffers: nothing that changes between steps.
        odd = {type(value).__name__ for value in inputs
               if type(value) not in (torch.Tensor, torch.nn.Parameter)}
        if odd:
            raise RuntimeError(f"a compiled decode program took inputs of type "
                               f"{', '.join(sorted(odd))}, not plain tensors, so it "
                               "cannot be called without its guards")
        with kv_caches_in_use(self.kv_caches):
            outputs = compiled(*inputs)
        if len(outputs) != 2 or any(out.shape != ref.shape
                                    for out, ref in zip(outputs, eager)):
            raise RuntimeError("a compiled decode program returned "
                               f"{[tuple(out.shape) for out in outputs]}, not its logits "
                               "and greedy result")
        # The same rows (padding) as the eager run: the logits must agree, up to the
        # rounding of fused float arithmetic.
        error = float((outputs[0] - eager[0]).abs().max())
        if not error <= 1e-3 * max(1.0, float(eager[0].abs().max())):
            raise RuntimeError(f"a compiled decode program's logits differ from the eager "
                               f"ones by {error:.3g}")
        program.compiled = compiled
        program.compiled_inputs = tuple(inputs)  # type: ignore[arg-type]

    def _compute(self, program: _Program) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's logits ``[size, vocab]`` and ``[size, 2]`` (greedy token, logits
        finite) for the rows in the static buffers."""
        hidden = self.model(program.token_ids, program.positions, self.kv_caches,
                            program.attention)
        logits = self.model.compute_logits(hidden)
        # The sampler's common path, captured with the model: greedy, and whether the row's
        # logits are finite (both reductions carry a NaN; +-inf lands in one of them).
        finite = torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))
        return logits, torch.stack([logits.argmax(dim=-1), finite.long()], dim=1)

    def _forward(self, program: _Program) -> None:
        program.logits, program.result = self._compute(program)

    # -- a step --------------------------------------------------------------------------------

    def run(self, chunks: Sequence[ScheduledChunk]) -> _Program:
        """Load the rows and run their size's graph (eagerly without graphs)."""
        size = self.size_for(len(chunks))
        if size is None or not graph_friendly(chunks):
            raise ValueError(f"{len(chunks)} chunks are not a decode batch of at most "
                             f"{self.max_size} rows")
        program = self._programs[size]
        used = self.load(chunks, size)
        self._inputs[:used].copy_(self._staging[:used], non_blocking=True)
        if self.use_graphs and program.graph is not None:
            program.graph.replay()
        elif program.compiled is not None:
            with torch.inference_mode(), kv_caches_in_use(self.kv_caches):
                program.logits, program.result = program.compiled(*program.compiled_inputs)
        else:
            with torch.inference_mode(), kv_caches_in_use(self.kv_caches):
                self._forward(program)
        self.runs += 1
        return program

    def greedy(self, program: _Program, num_rows: int) -> tuple[list[int], list[bool]]:
        """The greedy tokens and finite flags of the last run's first ``num_rows`` rows, in
        one device-to-host copy."""
        assert program.result is not None
        host = self._result_host[:num_rows]
        host.copy_(program.result[:num_rows], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        rows = host.tolist()
        return [token for token, _ in rows], [bool(ok) for _, ok in rows]

    @staticmethod
    def logits(program: _Program, num_rows: int) -> torch.Tensor:
        assert program.logits is not None
        return program.logits[:num_rows]

    def load(self, chunks: Sequence[ScheduledChunk], size: int) -> int:
        """Write the rows (and padding up to ``size``) into the staging buffer; returns how
        many of its leading entries the step needs copied."""
        host, largest, count = self._host, self.max_size, len(chunks)
        positions = np.fromiter((c.start_pos for c in chunks), np.int64, count)
        block_counts = np.fromiter((len(c.block_ids) for c in chunks), np.int64, count)
        host[:count] = [c.token_ids[0] for c in chunks]
        host[largest:largest + count] = positions
        host[2 * largest:2 * largest + count] = [
            c.block_ids[c.start_pos // BLOCK_SIZE] * BLOCK_SIZE + c.start_pos % BLOCK_SIZE
            for c in chunks]
        seq_info = host[self._seq_info_at:self._blocks_at].reshape(largest, SEQ_INFO_COLUMNS)
        seq_info[:count, 0] = np.arange(count)
        seq_info[:count, 1] = 1
        seq_info[:count, 2] = positions
        seq_info[:count, 3] = positions + 1
        seq_info[:count, 4] = 0
        seq_info[0, 5] = 0
        seq_info[1:count, 5] = np.cumsum(block_counts[:-1])
        num_blocks = int(block_counts.sum())
        if num_blocks > largest * self.blocks_per_seq:
            raise ValueError("the decode batch's block tables outgrow the graph's buffer")
        host[self._blocks_at:self._blocks_at + num_blocks] = np.fromiter(
            itertools.chain.from_iterable(c.block_ids for c in chunks), np.int64, num_blocks)
        self._pad_rows(count, size)
        return self._blocks_at + num_blocks

    def _pad_rows(self, first: int, end: int) -> None:
        host, largest = self._host, self.max_size
        host[first:end] = 0
        host[largest + first:largest + end] = 0
        host[2 * largest + first:2 * largest + end] = -1
        seq_info = host[self._seq_info_at:self._blocks_at].reshape(largest, SEQ_INFO_COLUMNS)
        seq_info[first:end] = 0
        seq_info[first:end, 0] = np.arange(first, end)
        seq_info[first:end, 1] = 1


def _describe(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else \
        f"{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}"
