"""The pool rebalancer (PLA-Serve Algorithm 2): pressure, P90, hysteresis, cooldown, minPerPool,
at most one move per cooldown."""

from __future__ import annotations

import pytest

from slipstream.crds.servingreplica import Rebalance, RebalanceWeights
from slipstream.decisions.pools import (
    AT_MIN_PER_POOL, BALANCED, COOLING_DOWN, MOVED, NO_STATS, InstanceSignals, Move, decide,
    instance_pressure, percentile, pool_pressures)

SETTINGS = Rebalance(period_seconds=10, cooldown_seconds=60, hysteresis=0.2, min_per_pool=1,
                     weights=RebalanceWeights(queue=1.0, slo_deviation=1.0, utilization=0.0))


def signal(name: str, pool: str, backlog_s: float = 0.0, deviation: float = 0.0,
           utilization: float = 0.0) -> InstanceSignals:
    return InstanceSignals(instance=name, pool=pool, queue_backlog_s=backlog_s,
                           slo_deviation=deviation, utilization=utilization)


def test_pressure_follows_the_papers_signs():
    weights = RebalanceWeights(queue=2.0, slo_deviation=3.0, utilization=0.5)
    assert instance_pressure(signal("i", "short", 1.0, 2.0, 0.8), weights) == \
        pytest.approx(2.0 * 1.0 + 3.0 * 2.0 - 0.5 * 0.8)


def test_p90_interpolates_and_ignores_one_idle_instance():
    assert percentile([], 0.9) is None
    assert percentile([5.0], 0.9) == 5.0
    assert percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert percentile(list(map(float, range(11))), 0.9) == pytest.approx(9.0)
    # One straggler in a pool of ten barely moves P90 ...
    pool = [signal(f"s{i}", "short", 1.0) for i in range(9)] + [signal("s9", "short", 100.0)]
    pressures = pool_pressures(pool, SETTINGS.weights)
    assert pressures["short"] == pytest.approx(1.0 + 0.1 * 99.0)
    assert pressures["long"] is None


def test_short_pool_under_pressure_takes_the_least_loaded_long_instance():
    signals = [signal("s0", "short", 4.0), signal("s1", "short", 5.0),
               signal("l0", "long", 0.5), signal("l1", "long", 0.1)]
    decision = decide(signals, SETTINGS, now_s=1000.0, last_move_s=None)
    assert decision.outcome == MOVED and decision.moves
    assert decision.move == Move("l1", "long", "short")
    assert decision.pressure_short > decision.pressure_long


def test_long_pool_under_pressure_takes_a_short_instance():
    signals = [signal("s0", "short"), signal("s1", "short", 0.2),
               signal("l0", "long", 9.0, deviation=2.0)]
    decision = decide(signals, SETTINGS, now_s=0.0, last_move_s=None)
    assert decision.move is not None
    assert (decision.move.instance, decision.move.to_pool) == ("s0", "long")


@pytest.mark.parametrize(("hot", "cold", "moves"), [
    (1.15, 1.0, False),  # 15 % apart: inside the 20 % band
    (1.25, 1.0, True),  # 25 % apart: outside
    (0.15, 0.0, False),  # near zero the band is absolute: 0.15 < 0.2
    (0.25, 0.0, True),
    (10.0, 9.0, False),  # 11 % apart
    (12.5, 10.0, True),
])
def test_hysteresis_band(hot, cold, moves):
    signals = [signal("s0", "short", hot), signal("s1", "short", hot),
               signal("l0", "long", cold), signal("l1", "long", cold)]
    decision = decide(signals, SETTINGS, now_s=0.0, last_move_s=None)
    assert decision.moves is moves
    assert decision.outcome == (MOVED if moves else BALANCED)


def test_negative_pressures_do_not_trigger_moves_on_noise():
    weights = RebalanceWeights(queue=1.0, slo_deviation=1.0, utilization=1.0)
    settings = SETTINGS.model_copy(update={"weights": weights})
    # Both pools busy (u ~ 0.9) with no backlog: pressures about -0.9 and -0.8.
    signals = [signal("s0", "short", utilization=0.9), signal("s1", "short", utilization=0.9),
               signal("l0", "long", utilization=0.8), signal("l1", "long", utilization=0.8)]
    assert not decide(signals, settings, now_s=0.0, last_move_s=None).moves


def test_cooldown_blocks_a_second_move():
    signals = [signal("s0", "short", 5.0), signal("l0", "long"), signal("l1", "long")]
    cooling = decide(signals, SETTINGS, now_s=1059.0, last_move_s=1000.0)
    assert cooling.outcome == COOLING_DOWN and not cooling.moves
    assert "cooling down" in cooling.reason
    after = decide(signals, SETTINGS, now_s=1060.0, last_move_s=1000.0)
    assert after.moves


def test_min_per_pool_keeps_the_donor_pool_alive():
    signals = [signal("s0", "short", 5.0), signal("s1", "short", 5.0), signal("l0", "long")]
    decision = decide(signals, SETTINGS, now_s=0.0, last_move_s=None)
    assert decision.outcome == AT_MIN_PER_POOL and not decision.moves
    relaxed = SETTINGS.model_copy(update={"min_per_pool": 0})
    relaxed_move = decide(signals, relaxed, now_s=0.0, last_move_s=None).move
    assert relaxed_move is not None and relaxed_move.instance == "l0"


def test_a_pool_without_stats_means_no_decision():
    decision = decide([signal("s0", "short", 5.0)], SETTINGS, now_s=0.0, last_move_s=None)
    assert decision.outcome == NO_STATS and not decision.moves


def test_closed_loop_moves_at_most_one_instance_per_cooldown():
    """Drive decide() every period with a short pool that stays overloaded, applying each
    move, and check the spacing of moves and that the long pool never drops below minimum."""
    pools = {"s0": "short", "s1": "short", "l0": "long", "l1": "long", "l2": "long",
             "l3": "long"}
    moves, last_move_s = [], None
    for step in range(60):
        now_s = step * SETTINGS.period_seconds
        signals = [signal(name, pool, 10.0 if pool == "short" else 0.0)
                   for name, pool in sorted(pools.items())]
        decision = decide(signals, SETTINGS, now_s, last_move_s)
        if decision.move is not None:
            pools[decision.move.instance] = decision.move.to_pool
            moves.append(now_s)
            last_move_s = now_s
    assert len(moves) == 3, "three long instances could move before the long pool hit its min"
    assert all(b - a >= SETTINGS.cooldown_seconds for a, b in zip(moves, moves[1:]))
    assert sum(1 for pool in pools.values() if pool == "long") == SETTINGS.min_per_pool
