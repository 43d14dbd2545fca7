"""Compiled CPU decode steps (decode_graphs.py ``compile_cpu``, kernels/cpu_static_decode.py):
the same tokens and logits as eager decodes, the attention operator against a plain softmax,
and where the path turns itself on, off, or refuses."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.engine.step.decode_graphs import CPU_WRAPPER_ENV, DecodeGraphs, cpu_wrapper
from slipstream.agent.engine.step.cpu_compile import cpu_compile_refusal, cpu_compile_sizes
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.contracts.sampling import SamplingParams
from slipstream.kernels.attention import SEQ_INFO_COLUMNS
from slipstream.agent.engine.models.tiny_model import slipstream_cache_dir
from slipstream.kernels import cpu_static_decode
from slipstream.kernels.cpu_static_decode import cpu_decode_attention, kv_caches_in_use

PROMPTS = [[5, 17, 99, 3, 41, 8], [44] * 19]


def engine(model_dir, **overrides) -> LLMEngine:
    # The float matmuls through torch (oneDNN-reordered weights are not compiled).
    settings = dict(model_dir=model_dir, device="cpu", dtype="float32", cpu_matmul="torch",
                    scheduler=SchedulerConfig(max_num_seqs=8), num_kv_blocks=64,
                    max_model_len=512)
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def test_compiled_decodes_give_the_eager_tokens_and_logprobs(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(CPU_WRAPPER_ENV, raising=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
    eager = engine(tiny_model_dir, cpu_compile=False)
    assert eager.runner.decode_graphs is None
    compiled = engine(tiny_model_dir, cpu_compile=True)
    graphs = compiled.runner.decode_graphs
    assert graphs is not None and graphs.sizes == (1, 2)
    assert graphs.cpu_wrapper == "cpp"  # inductor's C++ wrapper, the default
    assert all(program.compiled is not None for program in graphs._programs.values())
    # The programs attend through the C++ kernel (use_implementation answers what it chose).
    assert cpu_static_decode.use_implementation(None) == cpu_static_decode.NATIVE
    for prompts in (PROMPTS, PROMPTS[:1]):  # decode steps of two rows, then of one
        outputs = []
        for eng in (eager, compiled):
            for index, prompt in enumerate(prompts):
                eng.add_request(prompt, params, f"r{index}")
            logprobs: dict[str, list] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
            outputs.append(logprobs)
        want, got = outputs
        assert want.keys() == got.keys()
        for request_id in want:
            assert [lp.token_id for lp in got[request_id]] == \
                [lp.token_id for lp in want[request_id]]
            for a, b in zip(want[request_id], got[request_id]):
                assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
    # 2 prompts x 7 decode steps, then 7 more: every decode came from a compiled program.
    assert graphs.runs == 14
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert compiled.generate(PROMPTS, greedy) == eager.generate(PROMPTS, greedy)


def native_kernel() -> None:
    """The operator's C++ kernel, as compiled decodes register it (a C++ compiler is part
    of the setup: inductor needs one too)."""
    built = cpu_static_decode.use_implementation(
        slipstream_cache_dir() / "cpp" / "decode_attention")
    assert built == cpu_static_decode.NATIVE, "the C++ decode attention kernel did not build"


def call_operator(*args):
    native_kernel()
    return torch.ops.slipstream.cpu_decode_attention(*args)


def call_operator_through_sdpa(*args):
    """The C++ kernel's SDPA path, which contexts over 4,096 tokens (and other dtypes) take."""
    native_kernel()
    torch.ops.slipstream_cpu.set_force_sdpa(True)
    try:
        return torch.ops.slipstream.cpu_decode_attention(*args)
    finally:
        torch.ops.slipstream_cpu.set_force_sdpa(False)


@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("kernel", [cpu_decode_attention, call_operator,
                                    call_operator_through_sdpa],
                         ids=["python", "c++", "c++-sdpa"])
@pytest.mark.parametrize("table, padded", [
    ([7, 2], True),    # scattered blocks: the row's tokens are gathered
    ([1, 2], True),    # consecutive blocks: attention reads a view of the cache
    ([7, 2], False),   # a lone row, scattered
    ([1, 2], False),   # a lone row in consecutive blocks: the one-stream path
])
def test_operator_writes_the_rows_and_attends_like_a_plain_softmax(table, padded, kernel, dim):
    torch.manual_seed(0)
    blocks, block_size, kv_heads, heads = 12, 16, 2, 4
    k_cache = torch.randn(blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim)
    before = (k_cache.clone(), v_cache.clone())
    rows = 2 if padded else 1
    with kv_caches_in_use([(k_cache, v_cache)]):
        # Row 0 holds 21 tokens in the table's two blocks (its new token at position 20, in
        # the second block's slot 4); row 1, if any, is padding: no KV, slot -1.
        kv_len = 21
        seq_info = torch.zeros(rows, SEQ_INFO_COLUMNS, dtype=torch.int64)
        seq_info[0] = torch.tensor([0, 1, kv_len - 1, kv_len, 0, 0])
        block_indices = torch.tensor(table + [0, 0])
        slots = torch.tensor([table[1] * block_size + 4, -1][:rows])
        if padded:
            seq_info[1, 0], seq_info[1, 1] = 1, 1
        query, key, value = (torch.randn(rows, heads, dim), torch.randn(rows, kv_heads, dim),
                             torch.randn(rows, kv_heads, dim))
        out = kernel(query, key, value, 0, slots, seq_info, block_indices, 0.3)
    with pytest.raises(RuntimeError, match="inside kv_caches_in_use"):
        kernel(query, key, value, 0, slots, seq_info, block_indices, 0.3)
    # The new token is in its slot; nothing else in either cache changed.
    assert torch.equal(k_cache[table[1], 4], key[0])
    assert torch.equal(v_cache[table[1], 4], value[0])
    for cache, old in zip((k_cache, v_cache), before):
        changed = (cache != old).any(dim=-1).any(dim=-1).nonzero().tolist()
        assert changed == [[table[1], 4]]
    keys = k_cache[table].reshape(-1, kv_heads, dim)[:kv_len]
    values = v_cache[table].reshape(-1, kv_heads, dim)[:kv_len]
    group = heads // kv_heads
    for head in range(heads):
        scores = keys[:, head // group] @ query[0, head] * 0.3
        want = torch.softmax(scores, dim=0) @ values[:, head // group]
        assert torch.allclose(out[0, head], want, atol=1e-5)
    assert out.shape == (rows, heads, dim)
    if padded:
        assert torch.equal(out[1], torch.zeros(heads, dim))  # the padding row


def test_a_padded_program_serves_fewer_rows(tiny_model_dir):
    """A size-2 program (the only size asked for, --cpu-compile-batch-sizes 2) serving one
    row: the padding writes no KV and the row's logits are the eager engine's."""
    eager = engine(tiny_model_dir, cpu_compile=False)
    compiled = engine(tiny_model_dir, cpu_compile=True, cpu_compile_sizes=(2,))
    runner = compiled.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == (2,)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    before = [k.clone() for k, _ in runner.kv_caches]
    assert compiled.generate(PROMPTS[:1], params) == eager.generate(PROMPTS[:1], params)
    assert graphs.runs == 4
    # Every layer holds the request's tokens (its prompt and 4 decodes) and nothing else:
    # the padding row wrote nothing.
    for (k_cache, _), old in zip(runner.kv_caches, before):
        written = (k_cache != old).any(dim=-1).any(dim=-1)
        assert int(written.sum()) == len(PROMPTS[0]) + 4


def test_on_by_default_for_quantized_weights_only(tiny_model_dir):
    assert engine(tiny_model_dir).runner.decode_graphs is None  # float weights
    int8 = dict(quantization="int8")
    quantized = engine(tiny_model_dir, **int8)
    graphs = quantized.runner.decode_graphs
    assert graphs is not None and graphs.compile_s is not None
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = engine(tiny_model_dir, **int8, cpu_compile=False)
    assert quantized.generate(PROMPTS, params) == eager.generate(PROMPTS, params)
    assert graphs.runs > 0


def test_a_failed_compile_keeps_decodes_eager_unless_asked_for(tiny_model_dir, monkeypatch,
                                                                caplog):
    def fail(self):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(DecodeGraphs, "compile_cpu", fail)
    with caplog.at_level(logging.WARNING):
        quiet = engine(tiny_model_dir, quantization="int8")
    assert quiet.runner.decode_graphs is None
    assert "compiling CPU decode steps failed (RuntimeError: no C++ compiler found); " \
        "decodes run eagerly" in caplog.text
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        engine(tiny_model_dir, cpu_compile=True)


def test_what_the_compiled_path_cannot_run(tiny_model_dir):
    model = ModelConfig.from_dir(tiny_model_dir)
    config = EngineConfig(model_dir=tiny_model_dir, device="cpu")
    assert cpu_compile_refusal(config, model, "torch") is None
    capped = dataclasses.replace(model, attn_logit_softcap=50.0)
    assert "soft-capped" in cpu_compile_refusal(config, capped, "torch")
    assert "triton attention backend" in cpu_compile_refusal(config, model, "triton")
    assert "--cpu-matmul torch" in cpu_compile_refusal(config, model, "torch", "onednn")
    q8 = EngineConfig(model_dir=tiny_model_dir, device="cpu", gguf_file=tiny_model_dir / "x",
                      gguf_activations="q8")
    assert "measurement" in cpu_compile_refusal(q8, model, "torch")
    spp = EngineConfig(model_dir=tiny_model_dir, device="cpu",
                       parallel=ParallelConfig(spp=2))
    assert "single process" in cpu_compile_refusal(spp, model, "torch")
    with pytest.raises(ValueError, match="single process"):
        EngineConfig(model_dir=tiny_model_dir, cpu_compile=True, parallel=ParallelConfig(spp=2))
    with pytest.raises(ValueError, match="ask for one"):
        EngineConfig(model_dir=tiny_model_dir, cpu_compile=True, cuda_graphs=True)
    # Asked for where it cannot run: an error at start-up that says why.
    with pytest.raises(ValueError, match="--cpu-compile: sliding-window and soft-capped"):
        ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=16,
                                 cpu_matmul="torch", cpu_compile=True), capped)


def test_sizes_stop_at_two_rows_and_at_max_num_seqs():
    assert cpu_compile_sizes(256) == (1, 2)
    assert cpu_compile_sizes(2) == (1, 2)
    assert cpu_compile_sizes(1) == (1,)
    # --cpu-compile-batch-sizes 1,2,4,8: all of them, or up to --max-num-seqs
    assert cpu_compile_sizes(256, (1, 2, 4, 8)) == (1, 2, 4, 8)
    assert cpu_compile_sizes(6, (1, 2, 4, 8)) == (1, 2, 4, 6)
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineConfig(model_dir=Path("m"), device="cpu", cpu_compile_sizes=(4, 2))


def test_a_program_that_computes_other_logits_is_not_used(tiny_model_dir, monkeypatch):
    """The start-up check runs each compiled program once against the eager forward."""
    import torch._inductor.compile_fx as inductor

    real = inductor.compile_fx

    def off_by_one(graph, example_inputs):
        compiled = real(graph, example_inputs)
        return lambda *inputs: [out + 1 if out.is_floating_point() else out
                                for out in compiled(*inputs)]

    monkeypatch.setattr(inductor, "compile_fx", off_by_one)
    with pytest.raises(RuntimeError, match="logits differ from the eager ones by 1"):
        engine(tiny_model_dir, cpu_compile=True)


def test_a_failed_cpp_wrapper_falls_back_to_the_python_one(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.delenv(CPU_WRAPPER_ENV, raising=False)
    import torch._inductor.compile_fx as inductor
    from torch._inductor import config as inductor_config

    real = inductor.compile_fx

    def no_cpp_wrapper(graph, example_inputs):
        if inductor_config.cpp_wrapper:
            raise RuntimeError("g++: fatal error: killed\nmore detail")
        return real(graph, example_inputs)

    monkeypatch.setattr(inductor, "compile_fx", no_cpp_wrapper)
    with caplog.at_level(logging.WARNING):
        compiled = engine(tiny_model_dir, cpu_compile=True)
    assert compiled.runner.decode_graphs.cpu_wrapper == "python"
    assert "inductor's C++ wrapper failed for the size-1 decode program (RuntimeError: g++: " \
        "fatal error: killed); compiling with its Python wrapper" in caplog.text
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert compiled.generate(PROMPTS, greedy) == \
        engine(tiny_model_dir, cpu_compile=False).generate(PROMPTS, greedy)


def test_the_wrapper_is_asked_for_by_name(monkeypatch):
    monkeypatch.delenv(CPU_WRAPPER_ENV, raising=False)
    assert cpu_wrapper() == "cpp"
    monkeypatch.setenv(CPU_WRAPPER_ENV, "python")
    assert cpu_wrapper() == "python"
    monkeypatch.setenv(CPU_WRAPPER_ENV, "c++")
    with pytest.raises(ValueError, match="SLIPSTREAM_CPU_COMPILE_WRAPPER='c\\+\\+': use one of "
                                         "cpp, python"):
        cpu_wrapper()


@pytest.mark.parametrize("dim", [64, 128, 256, 80])  # AVX-512 kernels at 64/128/256; 80 plain
def test_many_rows_and_long_contexts_attend_like_a_plain_softmax_and_alone(dim):
    """Enough work to split over threads: each row's output is a plain softmax's, and is the
    same, bit for bit, when the row is alone in its call (a row does not depend on its batch)."""
    native_kernel()
    torch.manual_seed(1)
    blocks, block_size, kv_heads, heads = 80, 16, 2, 6
    k_cache = torch.randn(blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim)
    lengths = [300, 1, 17, 250, 16, 33]
    tables, start, seq_info = [], 0, torch.zeros(len(lengths), SEQ_INFO_COLUMNS, dtype=torch.int64)
    permutation = torch.randperm(blocks).tolist()  # scattered blocks
    for row, kv_len in enumerate(lengths):
        count = -(-kv_len // block_size)
        tables.append(permutation[start:start + count])
        seq_info[row] = torch.tensor([row, 1, kv_len - 1, kv_len, 0, start])
        start += count
    block_indices = torch.tensor([b for table in tables for b in table])
    slots = torch.tensor([tables[r][(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for r, n in enumerate(lengths)])
    query = torch.randn(len(lengths), heads, dim) * 3
    key, value = torch.randn(len(lengths), kv_heads, dim), torch.randn(len(lengths), kv_heads, dim)
    op = torch.ops.slipstream.cpu_decode_attention
    with kv_caches_in_use([(k_cache, v_cache)]):
        out = op(query, key, value, 0, slots, seq_info, block_indices, 0.125)
        alone = [op(query[r:r + 1], key[r:r + 1], value[r:r + 1], 0, slots[r:r + 1],
                    seq_info[r:r + 1], block_indices, 0.125) for r in range(len(lengths))]
    group = heads // kv_heads
    for row, kv_len in enumerate(lengths):
        assert torch.equal(out[row], alone[row][0]), row
        tokens = k_cache[tables[row]].reshape(-1, kv_heads, dim)[:kv_len]
        values = v_cache[tables[row]].reshape(-1, kv_heads, dim)[:kv_len]
        for head in range(heads):
            scores = tokens[:, head // group].double() @ query[row, head].double() * 0.125
            want = torch.softmax(scores, dim=0) @ values[:, head // group].double()
            assert torch.allclose(out[row, head].double(), want, atol=2e-5, rtol=1e-5), \
                (row, head)


def test_eager_decodes_of_a_compiled_engine_attend_in_the_cpp_kernel(tiny_model_dir):
    """Steps the programs do not cover (here five decodes, above the compiled sizes 1 and 2)
    run eagerly; their decodes attend in the same C++ kernel, and give the tokens and
    log-probabilities of an engine that never compiled."""
    compiled = engine(tiny_model_dir, cpu_compile=True)
    eager = engine(tiny_model_dir, cpu_compile=False)
    assert compiled.runner.backend.direct_decodes and not eager.runner.backend.direct_decodes
    calls = []
    real = compiled.runner.backend._run_fused

    def counting(*args, **kwargs):
        calls.append(compiled.runner.backend._direct is not None)
        return real(*args, **kwargs)

    compiled.runner.backend._run_fused = counting
    prompts = [[7 + i, 3 * i + 1, 40, 2 + i] * (i + 1) for i in range(5)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    results = []
    for eng in (eager, compiled):
        for index, prompt in enumerate(prompts):
            eng.add_request(prompt, params, f"r{index}")
        logprobs: dict[str, list] = {}
        while eng.has_unfinished():
            for out in eng.step():
                logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
        results.append(logprobs)
    assert any(calls), "no eager step attended its decodes in the C++ kernel"
    want, got = results
    for request_id in want:
        assert [lp.token_id for lp in got[request_id]] == [lp.token_id for lp in want[request_id]]
        for a, b in zip(want[request_id], got[request_id]):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)


def test_attend_decodes_reads_the_cache_like_the_operator_and_refuses_bad_rows():
    native_kernel()
    torch.manual_seed(2)
    blocks, block_size, kv_heads, heads, dim = 10, 16, 2, 4, 64
    k_cache = torch.randn(blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim)
    tables = torch.tensor([[7, 2, 0], [4, 0, 0], [1, 5, 9]])
    kv_lens = torch.tensor([21, 3, 40])
    query = torch.randn(3, heads, dim)
    out = torch.ops.slipstream_cpu.attend_decodes(query, k_cache, v_cache, tables, kv_lens, 0.2)
    group = heads // kv_heads
    for row in range(3):
        keys = k_cache[tables[row]].reshape(-1, kv_heads, dim)[:kv_lens[row]]
        values = v_cache[tables[row]].reshape(-1, kv_heads, dim)[:kv_lens[row]]
        for head in range(heads):
            scores = keys[:, head // group] @ query[row, head] * 0.2
            want = torch.softmax(scores, dim=0) @ values[:, head // group]
            assert torch.allclose(out[row, head], want, atol=1e-5)
    # The compiled steps' operator, given the same rows (its KV write is the token already
    # there), computes the same values bit for bit.
    seq_info = torch.zeros(3, SEQ_INFO_COLUMNS, dtype=torch.int64)
    for row in range(3):
        seq_info[row] = torch.tensor([row, 1, int(kv_lens[row]) - 1, int(kv_lens[row]), 0,
                                      3 * row])
    last = [int(tables[r][(int(kv_lens[r]) - 1) // block_size]) * block_size
            + (int(kv_lens[r]) - 1) % block_size for r in range(3)]
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    with kv_caches_in_use([(k_cache, v_cache)]):
        operator = torch.ops.slipstream.cpu_decode_attention(
            query, flat_k[last].clone(), flat_v[last].clone(), 0, torch.tensor(last), seq_info,
            tables.flatten(), 0.2)
    assert torch.equal(operator, out)
    with pytest.raises(RuntimeError, match="row 1 names block 10 of 10"):
        torch.ops.slipstream_cpu.attend_decodes(query, k_cache, v_cache,
                                                torch.tensor([[7, 2, 0], [10, 0, 0], [1, 5, 9]]),
                                                kv_lens, 0.2)
    with pytest.raises(RuntimeError, match="row 2 has 49 tokens"):
        torch.ops.slipstream_cpu.attend_decodes(query, k_cache, v_cache, tables,
                                                torch.tensor([21, 3, 49]), 0.2)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.slipstream_cpu.attend_decodes(query.double(), k_cache, v_cache, tables,
                                                kv_lens, 0.2)
