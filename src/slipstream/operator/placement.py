"""Gang, topology-aware placement of serving instances onto GPU nodes. Pure: no API calls.

    nodes (allocatable GPUs, labels, taints) + GPUs already requested by pods on them
      --place_instances(request, nodes, count)--> [InstancePlacement | PlacementFailure]
      --> builders: one pod per node share, pinned by required node affinity

An instance is ``tp x spp x kvp`` GPUs, that is ``spp * kvp`` TP groups of ``tp`` GPUs. A TP
group never spans nodes (its all-reduce runs every layer, over NVLink); SPP stages and KVP
groups may (they exchange activations or partial attention once per layer group or step).
So a node contributes whole TP groups: ``floor(min(free, gpusPerNode) / tp)`` of them.

Placement is all-or-nothing per instance. Per instance it prefers, in order:
1. one node, the tightest that fits (best fit leaves big holes for big instances);
2. otherwise the fewest nodes: take nodes with the most room first, then swap the last one
   for the tightest node that still covers the remainder.
Ties break by node name, so the same inputs always give the same placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Taint:
    key: str
    effect: str  # NoSchedule, PreferNoSchedule, NoExecute
    value: str = ""


@dataclass(frozen=True)
class TolerationRule:
    key: str | None = None
    operator: str = "Equal"  # or Exists
    value: str | None = None
    effect: str | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key is None:  # an empty key with Exists tolerates everything
            return self.operator == "Exists"
        if self.key != taint.key:
            return False
        return self.operator == "Exists" or (self.value or "") == taint.value


@dataclass(frozen=True)
class NodeGpus:
    """What placement needs to know about one node."""

    name: str
    allocatable_gpus: int
    used_gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    schedulable: bool = True  # False for cordoned or NotReady nodes

    @property
    def free_gpus(self) -> int:
        return max(0, self.allocatable_gpus - self.used_gpus)


@dataclass(frozen=True)
class PlacementRequest:
    tp: int
    spp: int
    kvp: int
    gpus_per_node: int
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[TolerationRule, ...] = ()
    ep: int = 1  # expert parallel: ep TP groups that share one node (see node_group)

    @property
    def node_group(self) -> int:
        """GPUs that must share a node: a TP group, or under expert parallelism its EP group
        of ``tp x ep`` (consecutive ranks; parallel_config.py)."""
        return self.tp * self.ep

    @property
    def tp_groups(self) -> int:
        """Node groups (TP groups, or EP groups under expert parallelism) per instance."""
        return self.spp * self.kvp

    @property
    def gpus(self) -> int:
        return self.node_group * self.tp_groups


@dataclass(frozen=True)
class NodeShare:
    """One pod of an instance: ``gpus`` GPUs on ``node``, ranks from ``first_rank``."""

    node: str
    gpus: int
    first_rank: int


@dataclass(frozen=True)
class InstancePlacement:
    shares: tuple[NodeShare, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(share.node for share in self.shares)


@dataclass(frozen=True)
class PlacementFailure:
    reason: str  # a CamelCase reason for conditions and Events
    message: str
    # True when no eligible node set could hold the instance even with all its GPUs free:
    # waiting does not help, only a spec change or new nodes do.
    permanent: bool = False


def eligible(node: NodeGpus, request: PlacementRequest) -> bool:
    if not node.schedulable:
        return False
    if any(node.labels.get(key) != value for key, value in request.node_selector.items()):
        return False
    blocking = [t for t in node.taints if t.effect in ("NoSchedule", "NoExecute")]
    return all(any(rule.tolerates(taint) for rule in request.tolerations) for taint in blocking)


def tp_slots(node: NodeGpus, request: PlacementRequest) -> int:
    """Whole TP groups this node can still host for one instance."""
    return min(node.free_gpus, request.gpus_per_node) // request.node_group


def place_instance(request: PlacementRequest,
                   nodes: list[NodeGpus]) -> InstancePlacement | PlacementFailure:
    candidates = sorted((n for n in nodes if eligible(n, request)), key=lambda n: n.name)
    if not candidates:
        return PlacementFailure("NoEligibleNodes", _no_nodes_message(request, nodes),
                                permanent=True)
    slots = {n.name: tp_slots(n, request) for n in candidates}
    needed = request.tp_groups
    if sum(slots.values()) < needed:
        idle = [replace(n, used_gpus=0) for n in candidates]
        never = sum(tp_slots(n, request) for n in idle) < needed
        message = _shortage_message(request, candidates, slots)
        if never:
            message += "; it would not fit even with every one of their GPUs free"
        return PlacementFailure("InsufficientGPUs", message, permanent=never)
    chosen = _choose_nodes(slots, needed)
    shares, rank = [], 0
    for node_name, groups in chosen:
        shares.append(NodeShare(node=node_name, gpus=groups * request.node_group,
                                first_rank=rank))
        rank += groups * request.node_group
    return InstancePlacement(tuple(shares))


def _choose_nodes(slots: dict[str, int], needed: int) -> list[tuple[str, int]]:
    """(node, TP groups) pairs covering ``needed`` groups on as few nodes as possible."""
    fitting = [name for name, free in slots.items() if free >= needed]
    if fitting:
        tightest = min(fitting, key=lambda name: (slots[name], name))
        return [(tightest, needed)]
    by_room = sorted((name for name in slots if slots[name] > 0),
                     key=lambda name: (-slots[name], name))
    chosen: list[tuple[str, int]] = []
    remaining = needed
    for index, name in enumerate(by_room):
        if slots[name] >= remaining:
            # The last share: the tightest node (not yet used) that covers the remainder.
            rest = [n for n in by_room[index:] if slots[n] >= remaining]
            last = min(rest, key=lambda n: (slots[n], n))
            chosen.append((last, remaining))
            return chosen
        chosen.append((name, slots[name]))
        remaining -= slots[name]
    raise AssertionError("caller checked that the total room covers the need")


def place_instances(request: PlacementRequest, nodes: list[NodeGpus],
                    count: int) -> list[InstancePlacement | PlacementFailure]:
    """Place ``count`` instances one after another, each consuming what it takes; once one
    fails, the rest fail with the same reason (they are identical)."""
    free = {node.name: node for node in nodes}
    results: list[InstancePlacement | PlacementFailure] = []
    for _ in range(count):
        outcome = place_instance(request, list(free.values()))
        results.append(outcome)
        if isinstance(outcome, PlacementFailure):
            results.extend([outcome] * (count - len(results)))
            break
        for share in outcome.shares:
            node = free[share.node]
            free[share.node] = replace(node, used_gpus=node.used_gpus + share.gpus)
    return results


def _no_nodes_message(request: PlacementRequest, nodes: list[NodeGpus]) -> str:
    selector = ",".join(f"{k}={v}" for k, v in sorted(request.node_selector.items())) or "none"
    return (f"no schedulable node matches spec.placement (nodeSelector: {selector}; "
            f"{len(nodes)} node(s) with GPUs seen, none eligible: check labels, taints "
            f"and tolerations)")


def _shortage_message(request: PlacementRequest, candidates: list[NodeGpus],
                      slots: dict[str, int]) -> str:
    free = ", ".join(f"{n.name}: {n.free_gpus} free" for n in candidates[:8])
    if len(candidates) > 8:
        free += f", ... ({len(candidates)} nodes)"
    ep = f", ep={request.ep}" if request.ep > 1 else ""
    return (f"an instance needs {request.gpus} GPUs as {request.tp_groups} TP group(s) of "
            f"{request.node_group} GPUs (tp={request.tp}{ep}, spp={request.spp}, "
            f"kvp={request.kvp}); a TP group cannot span nodes, and the eligible nodes offer "
            f"only "
            f"{sum(slots.values())} whole group(s) ({free})")
