"""The operator's side of the agent control API: one instance's load signals, and pool moves.

    handle_rebalance --read_signals(instance)--> gRPC Stats on the rank-0 pod --> InstanceSignals
    handle_rebalance --notify_pool(instance, pool)--> gRPC SetPool (metrics label follows)
    handle_autoscale --read_load(instance)--> gRPC Stats --> InstanceLoad (+ requests in flight)

Each call carries the replica's control token when the operator has a master key
(control_credentials.py). Calls block for at most ``timeout_s``; the rebalancer runs them
off the event loop. An agent that does not answer is left out of this step rather than
guessed at.
"""

from __future__ import annotations

import logging

import grpc

from slipstream.contracts.control import ControlClient
from slipstream.operator import naming
from slipstream.operator.instances import ObservedInstance
from slipstream.decisions.scale_signals import InstanceLoad
from slipstream.decisions.pools import InstanceSignals

log = logging.getLogger(__name__)


def control_target(instance: ObservedInstance) -> str | None:
    controller = instance.controller
    if controller is None or not controller.ip:
        return None
    host = f"[{controller.ip}]" if ":" in controller.ip else controller.ip
    return f"{host}:{naming.CONTROL_PORT}"


def _fetch_stats(instance: ObservedInstance, timeout_s: float, token: str | None):
    """The agent's stats over its control port; None when it has no address or does not
    answer (logged)."""
    target = control_target(instance)
    if target is None:
        return None
    try:
        with ControlClient(target, timeout_s=timeout_s, token=token) as client:
            return client.stats()
    except grpc.RpcError as error:
        log.warning("no stats from %s at %s: %s", instance.name, target, error.code())
        return None


def read_signals(instance: ObservedInstance, timeout_s: float = 2.0,
                 token: str | None = None) -> InstanceSignals | None:
    stats = _fetch_stats(instance, timeout_s, token)
    if stats is None:
        return None
    return InstanceSignals(instance=instance.name, pool=instance.pool,
                           queue_backlog_s=stats.queue_backlog_seconds,
                           slo_deviation=stats.slo_deviation, utilization=stats.utilization)


def read_load(instance: ObservedInstance, timeout_s: float = 2.0, token: str | None = None
              ) -> tuple[InstanceLoad, int] | None:
    """The instance's load window for the autoscaler, and its requests in flight (waiting
    plus running); None when the agent does not answer."""
    stats = _fetch_stats(instance, timeout_s, token)
    if stats is None:
        return None
    load = InstanceLoad(
        instance=instance.name, pool=instance.pool, first_tokens=stats.ttft_first_tokens,
        ttft_met=stats.ttft_met, finished=stats.tpot_finished, tpot_met=stats.tpot_met,
        queue_delay_s=stats.queue_backlog_seconds,
        kv_utilization=stats.kv_blocks_used / max(1, stats.kv_blocks_total),
        busy_fraction=stats.utilization, prefill_load=stats.prefill_load,
        slo_deviation=stats.slo_deviation)
    return load, stats.num_waiting + stats.num_running


def notify_pool(instance: ObservedInstance, pool: str, timeout_s: float = 2.0,
                token: str | None = None) -> bool:
    """Tell the agent its new pool (best effort: the pod label is what routes traffic)."""
    target = control_target(instance)
    if target is None:
        return False
    try:
        with ControlClient(target, timeout_s=timeout_s, token=token) as client:
            client.set_pool(pool)
    except grpc.RpcError as error:
        log.warning("could not tell %s its new pool %s: %s", instance.name, pool, error.code())
        return False
    return True
