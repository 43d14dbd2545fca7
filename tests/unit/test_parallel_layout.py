"""Rank layout, launch environment, pipeline stage split, and the scheduler's two parallel
hooks (the KVP chunk cap and the in-flight mark). Pure Python."""

from __future__ import annotations

import pytest

from slipstream.contracts.request import EngineRequest
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.models.layers import PipelineStage
from slipstream.agent.engine.parallel_config import ParallelConfig
from slipstream.agent.parallel.env import NodeEnv, WorkerEnv, parse_ranks
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import Request
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig


def test_rank_layout_tp_fastest_then_stage_then_kvp_group():
    config = ParallelConfig(tp=2, spp=2, kvp=2)
    assert config.world_size == 8
    coords = [config.coords(rank) for rank in range(8)]
    assert [(c.tp_rank, c.stage, c.kvp_group) for c in coords] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert all(config.rank_of(c.tp_rank, c.stage, c.kvp_group) == c.rank for c in coords)
    assert config.tp_group_ranks(stage=1, kvp_group=1) == [6, 7]
    assert config.kvp_group_ranks(tp_rank=1, stage=0) == [1, 5]
    assert config.sampler_rank == 2  # last stage, TP rank 0, KVP group 0


def test_parallel_config_rejects_bad_values():
    with pytest.raises(ValueError, match="tp"):
        ParallelConfig(tp=0)
    with pytest.raises(ValueError, match="multiple of the KV block"):
        ParallelConfig(kvp=2, kvp_tokens_per_group=100)
    assert ParallelConfig(kvp=3, kvp_tokens_per_group=64).max_context_tokens == 192


def test_env_is_read_in_one_place():
    node = NodeEnv.from_environ({"SLIPSTREAM_WORLD_SIZE": "16", "SLIPSTREAM_NODE_RANKS": "8-15",
                                 "SLIPSTREAM_CONTROLLER_ADDR": "ctl:5555",
                                 "MASTER_ADDR": "rank0", "MASTER_PORT": "29500"})
    assert node.node_ranks == tuple(range(8, 16)) and node.is_multi_node
    assert NodeEnv.from_environ({}).node_ranks is None
    worker = WorkerEnv(rank=9, local_rank=1, world_size=16, controller_addr="ctl:5555",
                       master_addr="rank0", master_port=29500)
    assert WorkerEnv.from_environ(worker.to_environ()) == worker
    with pytest.raises(RuntimeError, match="SLIPSTREAM_RANK"):
        WorkerEnv.from_environ({})
    assert parse_ranks("0-2,5") == (0, 1, 2, 5)
    with pytest.raises(ValueError):
        parse_ranks("0-2,2")


@pytest.mark.parametrize("num_layers,num_stages", [(4, 2), (5, 2), (7, 3), (32, 4)])
def test_pipeline_stages_cover_every_layer_once(num_layers, num_stages):
    stages = [PipelineStage.split(num_layers, num_stages, s) for s in range(num_stages)]
    layers = [index for stage in stages for index in stage.layer_indices]
    assert layers == list(range(num_layers))
    assert stages[0].is_first and stages[-1].is_last
    assert not any(s.is_first for s in stages[1:]) and not any(s.is_last for s in stages[:-1])
    sizes = [len(s.layer_indices) for s in stages]
    assert max(sizes) - min(sizes) <= 1


def _scheduler(**config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(64))


def test_kvp_cap_keeps_every_chunk_inside_one_group():
    scheduler = _scheduler(max_batched_tokens=100, kvp_tokens_per_group=64)
    scheduler.add(Request(EngineRequest("r", list(range(300)), SamplingParams(max_tokens=4)), 0.0))
    ends = []
    while scheduler.requests["r"].in_prefill:
        (chunk,) = scheduler.schedule(0.0).chunks
        assert chunk.start_pos // 64 == (chunk.end_pos - 1) // 64  # never crosses a boundary
        ends.append(chunk.end_pos)
        scheduler.update(Batch(chunks=(chunk,)), {}, 0.0)
    assert ends[:4] == [64, 128, 192, 256]


def test_in_flight_request_is_not_scheduled_until_cleared():
    scheduler = _scheduler(max_batched_tokens=512)
    scheduler.add(Request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=4)), 0.0))
    scheduler.add(Request(EngineRequest("b", [4, 5, 6], SamplingParams(max_tokens=4)), 1.0))
    first = scheduler.schedule(0.0)
    scheduler.update(first, {"a": 7, "b": 8}, 0.0)
    scheduler.requests["a"].in_flight = True
    assert [c.request_id for c in scheduler.schedule(0.0).chunks] == ["b"]
    scheduler.requests["a"].in_flight = False
    scheduler.requests["b"].in_flight = True
    assert [c.request_id for c in scheduler.schedule(0.0).chunks] == ["a"]
