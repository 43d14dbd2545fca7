"""CPU matmuls from oneDNN-reordered weights (``models/cpu_matmul.py``): what ``--cpu-matmul``
resolves to, the same logits and tokens as ``F.linear``, and the dense copies released."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.agent.engine.profile import auto_profile
from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.models.loader import load_model
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.cpu_matmul import (
    ReorderedLinear, onednn_available, pack_cpu_matmuls, resolve_cpu_matmul)
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.config import SchedulerConfig

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="PyTorch built without oneDNN")
CPU = torch.device("cpu")


def test_auto_takes_onednn_only_for_float32_on_cpu():
    expected = "onednn" if onednn_available() else "torch"
    assert resolve_cpu_matmul("auto", CPU, torch.float32) == expected
    assert resolve_cpu_matmul("auto", CPU, torch.bfloat16) == "torch"
    assert resolve_cpu_matmul("auto", torch.device("cuda"), torch.float32) == "torch"
    assert resolve_cpu_matmul("torch", CPU, torch.float32) == "torch"


def test_asking_for_onednn_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="needs float32 on CPU"):
        resolve_cpu_matmul("onednn", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="needs float32 on CPU"):
        resolve_cpu_matmul("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_matmul must be one of"):
        resolve_cpu_matmul("mkl", CPU, torch.float32)
    with pytest.raises(ValueError, match="cpu_matmul must be auto, onednn or torch"):
        EngineConfig(model_dir="unused", cpu_matmul="mkl")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32, 200])
def test_reordered_linear_equals_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator)
    bias = torch.randn(96, generator=generator)
    hidden = torch.randn(rows, 64, generator=generator)
    with torch.inference_mode():
        torch.testing.assert_close(ReorderedLinear(weight, bias)(hidden),
                                   torch.nn.functional.linear(hidden, weight, bias),
                                   rtol=1e-5, atol=1e-5)
        # Leading dimensions are kept, as nn.Linear keeps them.
        assert ReorderedLinear(weight)(hidden.view(1, rows, 64)).shape == (1, rows, 96)


@needs_onednn
def test_packed_model_drops_dense_projections_and_keeps_the_embedding(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, CPU, torch.float32, config)
    dense_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    # Per layer: fused q/k/v, o, fused gate/up, down; then the LM head.
    assert pack_cpu_matmuls(model) == 4 * config.num_layers + 1
    names = set(model.state_dict())
    assert "model.embed_tokens.weight" in names
    assert not any(name.endswith(("proj.weight", "lm_head.weight")) for name in names), names
    left = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert left < dense_bytes / 2
    layer = next(iter(model.model.layers.values()))
    assert layer.self_attn.q_proj is None and layer.self_attn.qkv_weight is None
    assert isinstance(layer.mlp.down_proj, ReorderedLinear)


def _greedy(model_dir, cpu_matmul: str) -> tuple[list[list[int]], torch.Tensor]:
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=256,
                                    cpu_matmul=cpu_matmul),
                       SchedulerConfig(max_batched_tokens=256, prefix_caching=False))
    try:
        assert engine.runner.cpu_matmul == cpu_matmul
        vocab = engine.model_config.vocab_size
        prompts = [[(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(9 + 5 * i)]
                   for i in range(6)]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while engine.has_unfinished():
            for output in engine.step():
                tokens[output.request_id].extend(output.new_token_ids)
        hidden = torch.randn(5, engine.model_config.hidden_size,
                             generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            logits = engine.runner.model.compute_logits(hidden)
        return [tokens[request_id] for request_id in ids], logits
    finally:
        engine.close()


@needs_onednn
def test_an_engine_on_reordered_weights_decodes_what_f_linear_decodes(tiny_model_dir):
    onednn_tokens, onednn_logits = _greedy(tiny_model_dir, "onednn")
    torch_tokens, torch_logits = _greedy(tiny_model_dir, "torch")
    assert onednn_tokens == torch_tokens
    assert all(len(tokens) == 12 for tokens in onednn_tokens)
    torch.testing.assert_close(onednn_logits, torch_logits, rtol=1e-4, atol=1e-4)


def test_the_runner_says_which_matmul_it_runs(tiny_model_dir):
    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=8,
                                      cpu_matmul="torch"), ModelConfig.from_dir(tiny_model_dir))
    assert runner.cpu_matmul == "torch"
    layer = next(iter(runner.model.model.layers.values()))
    assert type(layer.mlp.down_proj) is torch.nn.Linear


@needs_onednn
def test_a_profile_of_one_matmul_is_not_used_for_the_other(tiny_model_dir):
    threads = torch.get_num_threads()
    onednn = auto_profile.profile_key(tiny_model_dir, "auto", "cpu", threads, "quick", "auto")
    plain = auto_profile.profile_key(tiny_model_dir, "auto", "cpu", threads, "quick", "torch")
    assert onednn.engine_version != plain.engine_version
    assert "cpu matmul onednn" in onednn.engine_version


def test_decode_step_bench_times_both_paths_side_by_side(tiny_model_dir, tmp_path):
    from slipstream.bench import decode_step_bench

    assert decode_step_bench.main(["--model", str(tiny_model_dir), "--batches", "1,3",
                                   "--steps", "2", "--prompt-tokens", "8",
                                   "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_step.json").read_text())
    paths = ["onednn", "torch"] if onednn_available() else ["torch"]
    assert sorted(report["results"]) == sorted(paths)
    for rows in report["results"].values():
        assert [row["batch"] for row in rows] == [1, 3]
        assert all(row["step_ms_p50"] > 0 for row in rows)
    if onednn_available():
        ratios = report["onednn_over_torch_step_time"]
        assert set(ratios) == {"1", "3"} and all(value > 0 for value in ratios.values())


@needs_onednn
@pytest.mark.parametrize("failure", ["wrong results", "op raises"])
def test_a_onednn_that_misbehaves_leaves_the_model_on_f_linear(tiny_model_dir, monkeypatch,
                                                               caplog, failure):
    from slipstream.agent.engine.models import cpu_matmul

    if failure == "wrong results":
        monkeypatch.setattr(ReorderedLinear, "forward", lambda self, hidden: hidden.new_zeros(
            *hidden.shape[:-1], self.out_features))
    else:
        def broken(*args, **kwargs):
            raise RuntimeError("no such op")
        monkeypatch.setattr(cpu_matmul.ReorderedLinear, "__init__", broken)
    config = ModelConfig.from_dir(tiny_model_dir)
    model = load_model(tiny_model_dir, CPU, torch.float32, config)
    with caplog.at_level("WARNING", logger="slipstream.agent.engine.models.cpu_matmul"):
        assert pack_cpu_matmuls(model) == 0
    assert "keeping torch's" in caplog.text
    layer = next(iter(model.model.layers.values()))
    assert layer.mlp.gate_up_weight is not None and type(layer.mlp.down_proj) is torch.nn.Linear
