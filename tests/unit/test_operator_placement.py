"""Gang placement: TP groups stay on one node, best fit, fewest nodes, GPU accounting, selectors,
taints, and clear reasons when an instance cannot fit."""

from __future__ import annotations

import pytest

from slipstream.operator.capacity import gpu_nodes, pod_gpu_request
from slipstream.operator.placement import (
    InstancePlacement, NodeGpus, PlacementFailure, PlacementRequest, Taint, TolerationRule,
    place_instance, place_instances)

H100 = {"nvidia.com/gpu.product": "H100"}
A100 = {"nvidia.com/gpu.product": "A100"}


def node(name: str, free: int, total: int = 8, **kwargs) -> NodeGpus:
    return NodeGpus(name=name, allocatable_gpus=total, used_gpus=total - free, **kwargs)


def request(tp: int = 8, spp: int = 1, kvp: int = 1, gpus_per_node: int = 8, **kwargs):
    return PlacementRequest(tp=tp, spp=spp, kvp=kvp, gpus_per_node=gpus_per_node, **kwargs)


def shares(outcome) -> list[tuple[str, int]]:
    assert isinstance(outcome, InstancePlacement), outcome
    return [(share.node, share.gpus) for share in outcome.shares]


def test_two_tp8_instances_take_one_full_node_each():
    outcomes = place_instances(request(tp=8), [node("a", 8), node("b", 8)], 2)
    assert [shares(o) for o in outcomes] == [[("a", 8)], [("b", 8)]]


def test_tp_group_never_spans_nodes_even_when_total_gpus_suffice():
    outcome = place_instance(request(tp=8), [node("a", 4), node("b", 4)])
    assert isinstance(outcome, PlacementFailure)
    assert outcome.reason == "InsufficientGPUs"
    assert "cannot span nodes" in outcome.message
    assert "a: 4 free" in outcome.message and "b: 4 free" in outcome.message


def test_a_shortage_is_permanent_only_when_idle_nodes_could_not_hold_it_either():
    busy = place_instance(request(tp=8), [node("a", 4), node("b", 0)])
    assert isinstance(busy, PlacementFailure) and not busy.permanent  # wait for GPUs
    too_big = place_instance(request(tp=8, spp=4), [node("a", 8), node("b", 8)])
    assert isinstance(too_big, PlacementFailure) and too_big.permanent
    assert "even with every one of their GPUs free" in too_big.message
    nowhere = place_instance(request(tp=8, node_selector=H100), [node("a", 8)])
    assert isinstance(nowhere, PlacementFailure) and nowhere.permanent


def test_spp_stages_may_span_nodes_whole_tp_groups_per_node():
    # tp=4, spp=2: two TP groups of 4. No node has 8 free, so each node takes one group.
    outcome = place_instance(request(tp=4, spp=2), [node("a", 4), node("b", 6)])
    assert sorted(shares(outcome)) == [("a", 4), ("b", 4)]
    assert [share.first_rank for share in outcome.shares] == [0, 4]


def test_kvp_groups_span_nodes_on_as_few_nodes_as_possible():
    # 4 TP groups of 2 GPUs; nodes with room for 1, 2 and 3 groups: two nodes suffice.
    outcome = place_instance(request(tp=2, kvp=4), [node("a", 2), node("b", 4), node("c", 6)])
    placed = shares(outcome)
    assert len(placed) == 2
    assert sum(gpus for _, gpus in placed) == 8
    assert all(gpus % 2 == 0 for _, gpus in placed)


def test_best_fit_keeps_a_whole_node_free_for_a_big_instance():
    # A 4-GPU instance goes to the half-used node, leaving "b" whole for a later tp=8 one.
    nodes = [node("a", 4), node("b", 8)]
    outcomes = place_instances(request(tp=4), nodes, 1) + \
        place_instances(request(tp=8), [node("a", 0), node("b", 8)], 1)
    assert shares(outcomes[0]) == [("a", 4)]
    assert shares(outcomes[1]) == [("b", 8)]


def test_fragmentation_small_holes_do_not_add_up_to_a_tp_group():
    # 3 + 3 + 2 free GPUs: eight in total, but no room for even one tp=4 group pair.
    outcome = place_instance(request(tp=4, spp=2), [node("a", 3), node("b", 3), node("c", 2)])
    assert isinstance(outcome, PlacementFailure)
    assert "0 whole group(s)" in outcome.message


def test_gpus_per_node_caps_a_share():
    # Nodes have 8 free but the spec allows 4 per node: a tp=4 spp=2 instance needs 2 nodes.
    outcome = place_instance(request(tp=4, spp=2, gpus_per_node=4), [node("a", 8), node("b", 8)])
    assert sorted(shares(outcome)) == [("a", 4), ("b", 4)]


def test_instances_consume_capacity_in_order_and_the_rest_fail_alike():
    outcomes = place_instances(request(tp=8), [node("a", 8), node("b", 8)], 3)
    assert shares(outcomes[0]) == [("a", 8)] and shares(outcomes[1]) == [("b", 8)]
    assert isinstance(outcomes[2], PlacementFailure)


def test_node_selector_picks_the_gpu_type():
    nodes = [node("a100-0", 8, labels=A100), node("h100-0", 8, labels=H100)]
    outcome = place_instance(request(tp=8, node_selector=H100), nodes)
    assert shares(outcome) == [("h100-0", 8)]
    nothing = place_instance(request(tp=8, node_selector={"nvidia.com/gpu.product": "B200"}),
                             nodes)
    assert isinstance(nothing, PlacementFailure) and nothing.reason == "NoEligibleNodes"
    assert "nvidia.com/gpu.product=B200" in nothing.message


def test_taints_need_tolerations_and_cordoned_nodes_are_skipped():
    tainted = node("t", 8, taints=(Taint("dedicated", "NoSchedule", "llm"),))
    cordoned = node("c", 8, schedulable=False)
    assert isinstance(place_instance(request(), [tainted, cordoned]), PlacementFailure)
    tolerate = (TolerationRule(key="dedicated", operator="Equal", value="llm",
                               effect="NoSchedule"),)
    assert shares(place_instance(request(tolerations=tolerate), [tainted, cordoned])) == \
        [("t", 8)]
    prefer_only = node("p", 8, taints=(Taint("x", "PreferNoSchedule"),))
    assert shares(place_instance(request(), [prefer_only])) == [("p", 8)]


def test_placement_is_deterministic():
    nodes = [node(f"n{i}", 4) for i in range(6)]
    first = place_instances(request(tp=2, spp=2, kvp=2), nodes, 2)
    assert first == place_instances(request(tp=2, spp=2, kvp=2), list(reversed(nodes)), 2)


# -- capacity from API objects ------------------------------------------------------------------

def api_node(name: str, gpus: str, *, ready: bool = True, labels=None, unschedulable=False):
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable},
            "status": {"allocatable": {"nvidia.com/gpu": gpus, "cpu": "16"},
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def api_pod(node_name: str, gpus: str, *, phase: str = "Running", deleting: bool = False):
    metadata = {"name": f"p-{node_name}-{gpus}"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"phase": phase},
            "spec": {"nodeName": node_name, "containers": [
                {"resources": {"requests": {"cpu": "500m", "nvidia.com/gpu": gpus}}},
                {"resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}


def test_free_gpus_are_allocatable_minus_live_pods():
    nodes = [api_node("a", "8"), api_node("b", "8", ready=False), api_node("cpu-only", "0")]
    pods = [api_pod("a", "2"), api_pod("a", "1", phase="Succeeded"),
            api_pod("a", "4", deleting=True)]
    result = {n.name: n for n in gpu_nodes(nodes, pods, "nvidia.com/gpu")}
    assert set(result) == {"a", "b"}, "nodes without GPUs are not candidates"
    assert result["a"].free_gpus == 8 - 3, "2 requested + 1 from limits; terminal and " \
                                           "terminating pods give their GPUs back"
    assert not result["b"].schedulable


@pytest.mark.parametrize(("value", "expected"), [("4", 4), ("500m", 0), (None, 0)])
def test_pod_gpu_request_reads_whole_quantities(value, expected):
    pod = {"spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": value}}}]}}
    if value is None:
        pod = {"spec": {"containers": [{}]}}
    assert pod_gpu_request(pod, "nvidia.com/gpu") == expected


def test_an_expert_parallel_group_stays_on_one_node_and_stages_may_span_nodes():
    # tp=2, ep=2: EP groups of 4 GPUs; a node with 3 free cannot take one, though it has a
    # TP group's worth.
    outcome = place_instance(request(tp=2, ep=2), [node("a", 3), node("b", 4)])
    assert shares(outcome) == [("b", 4)]
    staged = place_instance(request(tp=2, ep=2, spp=2), [node("a", 4), node("b", 6)])
    assert sorted(shares(staged)) == [("a", 4), ("b", 4)]
    assert [share.first_rank for share in staged.shares] == [0, 4]
    short = place_instance(request(tp=2, ep=4), [node("a", 6), node("b", 6)])
    assert isinstance(short, PlacementFailure) and "8 GPUs (tp=2, ep=4" in short.message
