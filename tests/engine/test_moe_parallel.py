"""Expert and tensor parallelism on a mixture of experts (gloo on CPU): ``--ep 2``, ``--tp 2``
and both give exactly the single-process greedy tokens; the experts really are split."""

from __future__ import annotations

import pytest

from slipstream.agent.engine.config import EngineConfig, ModelConfig, check_parallel_fit
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.parallel.compose import build_engine
from slipstream.agent.scheduler.scheduler import SchedulerConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[(31 * i + 7 * j + 5) % 4000 for j in range(12 + 30 * i)] for i in range(3)]


def generate(model_dir, parallel: ParallelConfig) -> list[list[int]]:
    engine = build_engine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=64,
                                       parallel=parallel),
                          SchedulerConfig(max_batched_tokens=32))
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


@pytest.mark.parametrize("family,parallel", [
    ("mixtral", ParallelConfig(ep=2)),
    ("mixtral", ParallelConfig(tp=2)),
    ("qwen2_moe", ParallelConfig(ep=2)),
    ("qwen2_moe", ParallelConfig(tp=2, ep=2)),
    ("mixtral", ParallelConfig(ep=2, spp=2)),
    ("qwen3_moe", ParallelConfig(ep=2, kvp=2, kvp_tokens_per_group=48)),
], ids=["mixtral-ep2", "mixtral-tp2", "qwen2moe-ep2", "qwen2moe-tp2-ep2", "mixtral-ep2-spp2",
        "qwen3moe-ep2-kvp2"])
def test_parallel_moe_equals_single_process(moe_model_dirs, family, parallel):
    model_dir = moe_model_dirs[family]
    single = generate(model_dir, ParallelConfig())
    assert generate(model_dir, parallel) == single


def test_ep_rank_layout_and_groups():
    parallel = ParallelConfig(tp=2, ep=2, spp=2)
    assert parallel.world_size == 8
    coords = [parallel.coords(rank) for rank in range(8)]
    assert [(c.tp_rank, c.ep_rank, c.stage) for c in coords[:4]] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]
    assert parallel.ep_group_ranks(tp_rank=1, stage=1, kvp_group=0) == [5, 7]
    assert parallel.tp_group_ranks(stage=0, kvp_group=0, ep_rank=1) == [2, 3]
    assert parallel.sampler_rank == 4  # last stage, TP 0, EP 0


def test_misfitting_ep_is_refused_in_one_line(moe_model_dirs, tiny_model_dir):
    moe = ModelConfig.from_dir(moe_model_dirs["mixtral"])  # 8 experts
    with pytest.raises(ValueError, match=r"--ep 3 does not divide .* 8 experts"):
        check_parallel_fit(moe, ParallelConfig(ep=3))
    with pytest.raises(ValueError, match="no experts to split"):
        check_parallel_fit(ModelConfig.from_dir(tiny_model_dir), ParallelConfig(ep=2))
    with pytest.raises(ValueError, match="QK-norm spans every head"):
        check_parallel_fit(ModelConfig.from_dir(moe_model_dirs["olmoe"]), ParallelConfig(tp=2))


def test_expert_shards_sum_to_the_whole_mixture():
    """Two EP shards of four experts each, and two TP slices of every expert, add up to the
    eight-expert computation: what the all-reduce over the EP or TP group relies on."""
    import torch

    from slipstream.agent.engine.models.layers import ExpertShard
    from slipstream.agent.engine.models.moe import GroupedExperts

    torch.manual_seed(0)
    hidden, width, experts = 16, 12, 8
    gate_up, down = torch.randn(experts, 2 * width, hidden), torch.randn(experts, hidden, width)
    tokens = torch.randn(10, hidden)
    expert_ids = torch.stack([torch.randperm(experts)[:2] for _ in range(10)])
    weights = torch.rand(10, 2)

    def run(shard: ExpertShard) -> torch.Tensor:
        module = GroupedExperts(experts, hidden, width, shard)
        module.gate_up_proj.data = module.shard_tensor("gate_up_proj", gate_up)
        module.down_proj.data = module.shard_tensor("down_proj", down)
        return module(tokens, expert_ids, weights)

    whole = run(ExpertShard(0, experts))
    by_expert = run(ExpertShard(0, 4)) + run(ExpertShard(4, 4))
    by_slice = run(ExpertShard(0, experts, 0, 2)) + run(ExpertShard(0, experts, 1, 2))
    assert run(ExpertShard(4, 4)).abs().sum() > 0 and not torch.equal(by_expert, run(
        ExpertShard(0, 4)))
    torch.testing.assert_close(by_expert, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_slice, whole, atol=1e-5, rtol=1e-5)
