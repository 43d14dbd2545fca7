"""Mixed steps (prefill chunks beside decodes) through the piecewise graphs of
step/mixed_graphs.py: everything but attention from a graph of the padded token count.

On a CPU the pieces run eagerly, over the same static buffers and padding a CUDA graph
replays, so the bookkeeping is checked here against the model's own forward, on the tiny
Llama and on the families whose layers differ most (Qwen3's QK-norm; Gemma 3's sandwich
norms, sliding windows and local RoPE). The ``gpu`` test captures and replays real graphs.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.step.mixed_graphs import MixedGraphs
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.contracts.sampling import SamplingOptions, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingOptions(temperature=0.0)
# float32 on CUDA: cuBLAS may pick other kernels for the padded shapes than for the step's.
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4


def make_runner(model_dir, cuda_graphs: bool, backend: str = "torch") -> ModelRunner:
    config = EngineConfig(model_dir=model_dir, device=DEVICE, dtype="float32",
                          scheduler=SchedulerConfig(max_num_seqs=8), num_kv_blocks=64,
                          max_model_len=1024, attention_backend=backend,
                          cuda_graphs=cuda_graphs)
    return ModelRunner(config, ModelConfig.from_dir(model_dir))


def chunk(request: str, tokens: list[int], start: int, blocks: range) -> ScheduledChunk:
    return ScheduledChunk(request, tuple(tokens), start, tuple(blocks), True, GREEDY)


def steps(vocab: int) -> list[tuple[Batch, bool]]:
    """Four steps over three sequences, and whether each is small enough for the pieces:
    two prompts' chunks; a decode, a prompt's last chunk and a fresh prompt; a 600-token
    prompt alone (eager); two decodes."""
    generator = torch.Generator().manual_seed(3)

    def tokens(count: int) -> list[int]:
        return torch.randint(5, vocab, (count,), generator=generator).tolist()

    a, b, c, d = tokens(41), tokens(30), tokens(601), tokens(5)
    blocks_a, blocks_b, blocks_c, blocks_d = range(0, 3), range(3, 5), range(10, 48), range(5, 6)
    return [
        (Batch(chunks=(chunk("a", a[:40], 0, blocks_a), chunk("b", b[:20], 0, blocks_b))), True),
        (Batch(chunks=(chunk("a", a[40:41], 40, blocks_a), chunk("b", b[20:], 20, blocks_b),
                       chunk("d", d, 0, blocks_d))), True),
        (Batch(chunks=(chunk("c", c[:600], 0, blocks_c),)), False),
        (Batch(chunks=(chunk("c", c[600:], 600, blocks_c),
                       chunk("d", [9], 5, blocks_d))), True),
    ]


def check_pieces_equal_the_forward(model_dir, backend: str = "torch") -> ModelRunner:
    eager, pieces = make_runner(model_dir, False, backend), make_runner(model_dir, True, backend)
    assert eager.mixed_graphs is None and isinstance(pieces.mixed_graphs, MixedGraphs)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    for batch, small in steps(vocab):
        runs = pieces.mixed_graphs.runs
        expected = eager.sample_logits(batch)
        got = pieces.sample_logits(batch)
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=TOLERANCE)
        assert pieces.mixed_graphs.runs == runs + small
    # The KV both wrote is the same (the pieces write only the real tokens' slots).
    for (k_eager, v_eager), (k_pieces, v_pieces) in zip(eager.kv_caches, pieces.kv_caches):
        torch.testing.assert_close(k_pieces, k_eager, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(v_pieces, v_eager, atol=TOLERANCE, rtol=TOLERANCE)
    return pieces


def test_pieces_equal_the_models_forward(tiny_model_dir):
    pieces = check_pieces_equal_the_forward(tiny_model_dir)
    graphs = pieces.mixed_graphs
    assert graphs.size_for(1) == 64 and graphs.size_for(65) == 128
    assert graphs.size_for(512) == 512 and graphs.size_for(513) is None


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_pieces_equal_the_forward_of_other_families(family_model_dirs, family):
    check_pieces_equal_the_forward(family_model_dirs[family])


def test_padding_rows_write_no_kv(tiny_model_dir):
    runner = make_runner(tiny_model_dir, True)
    before = [k.clone() for k, _ in runner.kv_caches]
    # 3 + 1 tokens, padded to 64: only blocks 7 and 2 may change.
    batch = Batch(chunks=(chunk("x", [11, 12, 13], 0, range(7, 8)),
                          chunk("y", [21], 4, range(2, 3))))
    runner.sample_logits(batch)
    assert runner.mixed_graphs.runs == 1
    for (k_cache, _), old in zip(runner.kv_caches, before):
        changed = (k_cache != old).flatten(1).any(1).nonzero().flatten().tolist()
        assert changed == [2, 7]


def test_an_engine_serves_the_same_tokens_through_the_pieces(tiny_model_dir):
    """Greedy generation with prompts arriving beside running decodes (mixed steps)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 99, 3], [44] * 19, list(range(7, 40)), [301, 302]]
    outputs = []
    for cuda_graphs in (False, True):
        engine = LLMEngine(EngineConfig(
            model_dir=tiny_model_dir, device=DEVICE, dtype="float32",
            scheduler=SchedulerConfig(max_num_seqs=8), num_kv_blocks=64, max_model_len=512,
            attention_backend="torch", cuda_graphs=cuda_graphs))
        for index, prompt in enumerate(prompts[:2]):
            engine.add_request(prompt, params, f"early{index}")
        tokens: dict[str, list[int]] = {}

        def collect(step_outputs) -> None:
            for out in step_outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

        collect(engine.step())  # the first two prompts start decoding ...
        for index, prompt in enumerate(prompts[2:]):  # ... when the others arrive
            engine.add_request(prompt, params, f"late{index}")
        while engine.has_unfinished():
            collect(engine.step())
        assert all(len(ids) == 6 for ids in tokens.values())
        outputs.append(tokens)
        if cuda_graphs:
            assert engine.runner.mixed_graphs.runs >= 2
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4


@pytest.mark.gpu
def test_piecewise_graphs_on_cuda_equal_eager_without_syncs(tiny_model_dir):
    eager = make_runner(tiny_model_dir, False, "triton")
    graphed = make_runner(tiny_model_dir, True, "triton")
    graphs = graphed.mixed_graphs
    assert graphs is not None and graphs.use_graphs and graphs.capture_s is not None
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    for batch, small in steps(vocab):
        expected = eager.sample_logits(batch)
        got = _logits_without_sync(graphed, batch) if small else graphed.sample_logits(batch)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert graphs.runs == 3


def _logits_without_sync(runner: ModelRunner, batch: Batch) -> torch.Tensor:
    """The logits of ``batch``, with CUDA's sync check raising on any synchronisation
    while the pieces and their eager attention run (the runner itself synchronises once
    after the forward, to time it)."""
    input_ids, positions, metadata, _, sample_index = runner._prepare(batch)
    runner.backend.plan(metadata)
    torch.cuda.set_sync_debug_mode("error")
    try:
        hidden = runner.mixed_graphs.forward(input_ids, positions, runner.backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits = runner.model.compute_logits(hidden.index_select(0, sample_index))
    torch.cuda.synchronize()
    return logits


def test_the_start_up_check_catches_a_piece_that_replays_wrongly(tiny_model_dir):
    """capture() compares each size's replays with the same pieces run eagerly; here the
    pieces stand in for the replays, once faithful and once with a broken middle piece."""
    graphs = make_runner(tiny_model_dir, True).mixed_graphs
    size = graphs._sizes[64]
    before = (size.angles, size.hidden)
    graphs.check(size, graphs._pieces(size))
    assert (size.angles, size.hidden) == before  # the check leaves the bound outputs alone
    pieces = graphs._pieces(size)
    middle = pieces[1]

    def broken() -> None:
        middle()
        graphs._residual.mul_(1.5)

    pieces[1] = broken
    with pytest.raises(RuntimeError, match="differ from the same pieces run eagerly"):
        graphs.check(size, pieces)
