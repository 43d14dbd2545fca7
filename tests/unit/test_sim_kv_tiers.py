"""KV tiers in the simulator: a prefix evicted from a small device pool is found in the host
tier (or on disk), counted per tier, and the hit rate climbs to the unbounded bound."""

from __future__ import annotations

import pytest

from slipstream.agent.scheduler.config import SchedulerConfig
from slipstream.agent.scheduler.predictor import AnalyticModel
from slipstream.sim.instance import InstanceConfig
from slipstream.sim.report import summarize
from slipstream.sim.simulator import SimConfig, simulate
from slipstream.sim.traces import TraceRequest

MODEL = AnalyticModel(ms_per_token=0.05, ms_per_attended_pair=1e-7, ms_per_decode_kv_token=1e-5,
                      iteration_overhead_ms=0.5)
BLOCK_BYTES = 2 << 20


def conversations() -> list[TraceRequest]:
    """Eight 4K-token documents, each asked twice, the second time after the other seven
    have gone through a device pool that holds two of them."""
    docs = [tuple(range(100 * d, 100 * d + 8)) for d in range(8)]  # 8 x 512 tokens each
    first = [TraceRequest(d * 1.0, 4096 + 64, 4, "t", docs[d] + (9000 + d,)) for d in range(8)]
    again = [TraceRequest(20.0 + d, 4096 + 64, 4, "t", docs[d] + (9100 + d,)) for d in range(8)]
    return first + again


def run(host_blocks: int = 0, disk_blocks: int = 0):
    instance = InstanceConfig(num_kv_blocks=600, link_latency_ms=0.0,
                              kv_host_blocks=host_blocks, kv_disk_blocks=disk_blocks,
                              kv_bytes_per_block=BLOCK_BYTES if host_blocks else 0,
                              host_load_gb_per_s=50.0, disk_read_gb_per_s=5.0)
    result = simulate(conversations(), SimConfig(scheduler=SchedulerConfig(policy="lars"),
                                                 instance=instance), MODEL)
    return result, summarize(result, 8192, None)


def test_a_host_tier_finds_what_the_device_evicted():
    _, plain = run()
    result, tiered = run(host_blocks=4000)
    assert plain["prefix_cache"]["fraction_of_bound"] < 0.5
    assert tiered["prefix_cache"]["fraction_of_bound"] == pytest.approx(1.0, abs=0.02)
    by_tier = tiered["prefix_cache"]["hit_tokens_by_tier"]
    assert by_tier["host"] > 0 and by_tier["disk"] == 0
    assert tiered["completed"] == 16


def test_a_disk_tier_below_a_small_host_tier_is_fetched_then_loaded():
    result, tiered = run(host_blocks=700, disk_blocks=8000)
    by_tier = tiered["prefix_cache"]["hit_tokens_by_tier"]
    assert by_tier["disk"] > 0
    assert tiered["prefix_cache"]["fraction_of_bound"] == pytest.approx(1.0, abs=0.02)
    assert tiered["completed"] == 16
    # A disk hit waits for its fetch: the second question's TTFT includes bytes / 5 GB/s.
    second = [r for r in result.records if r.arrival_s >= 20.0]
    assert all(r.first_token_s is not None for r in second)


def test_simulate_flags_size_the_tiers_in_blocks_of_the_profiles_model(tmp_path, capsys):
    import argparse
    import json

    from slipstream.sim import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--trace", "mooncake", "--num-requests", "40", "--policies",
                              "lars", "--no-progress", "--kv-host-memory-gib", "1024",
                              "--kv-disk-gib", "2048", "--num-kv-blocks", "20000"])
    _, meta = cli.load_model(args.profile)
    config = cli.build_sim_config(args, meta, cli.policy_configs(args)[0][1])
    assert config.instance.kv_bytes_per_block == 2 << 20  # Llama-3-8B: 128 KiB per token
    assert config.instance.kv_host_blocks == 524_288 and config.instance.kv_disk_blocks == 1 << 20
    assert config.instance.host_load_gb_per_s == 25.0 * 8  # eight GPUs' PCIe links
    assert cli.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["prefix_cache"]["hit_tokens_by_tier"]) == {"device", "host", "disk"}
    bad = parser.parse_args(["--trace", "mooncake", "--kv-disk-gib", "10"])
    with pytest.raises(ValueError, match="kv-host-memory-gib"):
        cli.build_sim_config(bad, meta, cli.policy_configs(bad)[0][1])
