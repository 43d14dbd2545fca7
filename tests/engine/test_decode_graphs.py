"""Decode steps through the static graph path (decode_graphs.py), and a forward that never
waits for the device.

On a CPU the static path runs eagerly with the Triton kernels under the interpreter: the
same buffers, padding and copies a CUDA graph replays, so its bookkeeping is checked here;
the ``gpu`` tests capture and replay real graphs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.engine.step.decode_graphs import capture_sizes
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.contracts.sampling import SamplingOptions
from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.kernels.triton_backend import interpreting

needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and not interpreting(),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 99, 3], [44] * 19, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                       21, 22, 23, 24], [301, 302]]


def test_capture_sizes_follow_powers_of_two_then_steps_of_16():
    assert capture_sizes(256) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160,
                                  176, 192, 208, 224, 240, 256)
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1) == (1,)


def engine(model_dir, **overrides) -> LLMEngine:
    settings = dict(model_dir=model_dir, device=DEVICE, dtype="float32",
                    scheduler=SchedulerConfig(max_num_seqs=8), num_kv_blocks=64,
                    max_model_len=512)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


@needs_triton
def test_graph_decodes_equal_eager_torch_decodes(tiny_model_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    reference = engine(tiny_model_dir, attention_backend="torch", cuda_graphs=False)
    assert reference.runner.decode_graphs is None
    expected = reference.generate(PROMPTS, params)
    graphed = engine(tiny_model_dir, attention_backend="triton", cuda_graphs=True)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4, 8)
    assert graphed.generate(PROMPTS, params) == expected
    # Four prompts of 6 tokens: 5 decode steps of 4 rows each, all from the static path.
    assert graphs.runs >= 5


@needs_triton
def test_rows_that_need_the_sampler_take_the_graph_logits(tiny_model_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    reference = engine(tiny_model_dir, attention_backend="torch", cuda_graphs=False)
    graphed = engine(tiny_model_dir, attention_backend="triton", cuda_graphs=True)
    outputs = []
    for eng in (reference, graphed):
        eng.add_request(PROMPTS[1], params, "r")
        logprobs = []
        while eng.has_unfinished():
            for out in eng.step():
                logprobs.extend(out.logprobs or [])
        outputs.append(logprobs)
    assert graphed.runner.decode_graphs.runs >= 3
    assert [lp.token_id for lp in outputs[0]] == [lp.token_id for lp in outputs[1]]
    for want, got in zip(*outputs):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


@needs_triton
def test_padding_rows_write_no_kv(tiny_model_dir):
    config = EngineConfig(model_dir=tiny_model_dir, device=DEVICE, dtype="float32",
                          scheduler=SchedulerConfig(max_num_seqs=8), num_kv_blocks=32,
                          max_model_len=256,
                          attention_backend="triton", cuda_graphs=True)
    runner = ModelRunner(config, ModelConfig.from_dir(tiny_model_dir))
    # Three decodes (padded to the graph of 4) in blocks 3, 9 and 20.
    chunks = tuple(ScheduledChunk(f"r{i}", (11 + i,), pos, (block,), True,
                                  SamplingOptions(temperature=0.0))
                   for i, (pos, block) in enumerate([(4, 3), (9, 9), (15, 20)]))
    before = [k.clone() for k, _ in runner.kv_caches]
    sampled = runner.execute(Batch(chunks=chunks))
    assert set(sampled) == {"r0", "r1", "r2"} and runner.decode_graphs.runs == 1
    for (k_cache, _), old in zip(runner.kv_caches, before):
        changed = (k_cache != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [3, 9, 20]
        slots = [(3, 4), (9, 9), (20, 15)]
        for block, offset in slots:  # only the one slot of each row changed
            rows = (k_cache[block] != old[block]).flatten(1).any(1).nonzero().flatten()
            assert rows.tolist() == [offset % BLOCK_SIZE]


class _NoSync(contextlib.AbstractContextManager):
    """Fail on any tensor-to-host read while the model's forward runs."""

    NAMES = ("item", "tolist", "cpu", "numpy")

    def __init__(self, model: torch.nn.Module, mixed_graphs=None) -> None:
        """``mixed_graphs``: a runner's piecewise graphs, whose forward runs the model's
        parts without calling the model, guarded the same way."""
        self.model = model
        self.mixed_graphs = mixed_graphs
        self.inside = False
        self.calls: list[str] = []
        self.mixed_runs = 0

    def __enter__(self):
        self.originals = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, self._guard(name, original))
        self.hooks = [self.model.register_forward_pre_hook(lambda *_: self._set(True)),
                      self.model.register_forward_hook(lambda *_: self._set(False))]
        mixed = self.mixed_graphs
        if mixed is not None:
            original_forward = mixed.forward

            def guarded_forward(*args, **kwargs):
                self._set(True)
                try:
                    return original_forward(*args, **kwargs)
                finally:
                    self._set(False)
                    self.mixed_runs += 1
            mixed.forward = guarded_forward
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        for hook in self.hooks:
            hook.remove()
        if self.mixed_graphs is not None:
            del self.mixed_graphs.forward  # the class's method again
        return False

    def _set(self, inside: bool) -> None:
        self.inside = inside

    def _guard(self, name, original):
        def guarded(tensor, *args, **kwargs):
            if self.inside:
                self.calls.append(name)
            return original(tensor, *args, **kwargs)
        return guarded


@needs_triton
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_forward_never_reads_a_tensor_back(tiny_model_dir, cuda_graphs):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng = engine(tiny_model_dir, attention_backend="triton", cuda_graphs=cuda_graphs)
    model = eng.runner.model
    with _NoSync(model, eng.runner.mixed_graphs) as guard:
        # Mixed steps (prefills beside decodes), a cached prefix, and decode-only steps.
        eng.generate(PROMPTS, params)
        eng.generate([PROMPTS[2] + [77, 78]], params)
        forward_ran = guard.inside is False
    assert forward_ran and guard.calls == []
    # With graphs, the steps with prefills went through the piecewise graphs' forward.
    assert (guard.mixed_runs > 0) == cuda_graphs
    # The guard does catch a read inside the forward, on either path: the first layer's
    # attention runs eagerly in both (the norms of the piecewise path replay from CUDA
    # graphs on a GPU, where a hook on them would never run).
    attention = model.model.layers["0"].self_attn
    attend = attention.attend

    def read_back(query, *args, **kwargs):
        query.max().item()
        return attend(query, *args, **kwargs)

    with _NoSync(model, eng.runner.mixed_graphs) as guard:
        attention.attend = read_back
        try:
            eng.generate([PROMPTS[0]], SamplingParams(max_tokens=1, ignore_eos=True))
        finally:
            del attention.attend  # the class's method again
    assert "item" in guard.calls


@pytest.mark.gpu
def test_graph_replay_on_cuda_equals_eager_and_syncs_only_to_read_tokens(tiny_model_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = engine(tiny_model_dir, attention_backend="triton", cuda_graphs=False)
    expected = eager.generate(PROMPTS, params)
    graphed = engine(tiny_model_dir, attention_backend="triton", cuda_graphs=True)
    graphs = graphed.runner.decode_graphs
    assert graphs.use_graphs and graphs.capture_s is not None
    assert graphed.generate(PROMPTS, params) == expected
    assert graphs.runs >= 11
    # No synchronisation inside the model forward on CUDA: the sync debug mode raises on one.
    # The prompt's step runs the piecewise graphs' forward, not the model's: guard both.
    model, mixed = graphed.runner.model, graphed.runner.mixed_graphs
    hooks = [model.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("error")),
             model.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"))]
    mixed_forward, mixed_runs = mixed.forward, mixed.runs

    def strict_forward(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return mixed_forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    mixed.forward = strict_forward
    try:
        assert graphed.generate([PROMPTS[1] + [5] * 40], params)
    finally:
        for hook in hooks:
            hook.remove()
        del mixed.forward
        torch.cuda.set_sync_debug_mode("default")
    assert mixed.runs > mixed_runs
