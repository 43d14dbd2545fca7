"""How the router's table turns the stats poller's verdicts into its /health: which instances
count as serving, and for how long a refused, late or failed one stays out."""

from __future__ import annotations

from slipstream.agent.router.instances import (
    COOLING_DOWN, LATE, NOT_SERVING, SERVING, UNKNOWN, UNRESPONSIVE, UNRESPONSIVE_AFTER_S,
    BackendSpec, InstanceTable)


class ManualClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def table_of(*names: str) -> tuple[InstanceTable, ManualClock]:
    clock = ManualClock()
    table = InstanceTable(clock=clock)
    for name in names:
        table.upsert(BackendSpec(name=name, url=f"http://{name}", pool="short", instance=name))
    return table, clock


def states(table: InstanceTable) -> dict[str, str]:
    return {view["name"]: view["state"] for view in table.health_view()}


def test_only_instances_a_poll_found_serving_are_counted():
    table, clock = table_of("a", "b", "c")
    assert table.serving_count() == 0 and set(states(table).values()) == {UNKNOWN}
    table.get("a").polled(SERVING, clock.now_s)
    table.get("b").polled(NOT_SERVING, clock.now_s, "ConnectError: refused")
    assert table.serving_count() == 1
    assert states(table) == {"a": SERVING, "b": NOT_SERVING, "c": UNKNOWN}
    view = {v["name"]: v for v in table.health_view()}
    assert view["b"]["reason"] == "ConnectError: refused"
    assert view["b"]["last_answer_seconds_ago"] == 0.0 and view["c"]["last_answer_seconds_ago"] is None


def test_a_refused_instance_stays_out_after_its_cooldown_until_a_poll_finds_it_back():
    table, clock = table_of("dead", "live")
    table.get("live").polled(SERVING, clock.now_s)
    dead = table.get("dead")
    dead.mark_failed(clock.now_s, cooldown_s=0.1)
    dead.polled(NOT_SERVING, clock.now_s, "ConnectError")
    assert [i.name for i in table.candidates("short")] == ["live"]
    clock.now_s += 60  # the cooldown is long past, and no poll said it came back
    assert table.serving_count() == 1 and states(table)["dead"] == NOT_SERVING
    # Dispatch tries it again after the cooldown (a refused connection is retried
    # elsewhere); only /health waits for a poll to find it back.
    assert sorted(i.name for i in table.candidates("short")) == ["dead", "live"]
    dead.polled(SERVING, clock.now_s)
    assert table.serving_count() == 2


def test_late_is_counted_until_it_has_been_silent_too_long():
    table, clock = table_of("slow")
    slow = table.get("slow")
    slow.polled(SERVING, clock.now_s)
    clock.now_s += 5
    slow.polled(LATE, clock.now_s, "no answer in 5 s")
    assert states(table) == {"slow": LATE} and table.serving_count() == 1
    clock.now_s += UNRESPONSIVE_AFTER_S
    assert states(table) == {"slow": UNRESPONSIVE} and table.serving_count() == 0
    assert table.candidates("short") == [slow]  # slowness is not death: it keeps traffic


def test_an_instance_that_never_answered_is_not_counted_when_late():
    table, clock = table_of("silent")
    table.get("silent").polled(LATE, clock.now_s, "no answer in 5 s")
    assert states(table) == {"silent": UNRESPONSIVE} and table.serving_count() == 0


def test_a_request_failure_takes_an_instance_out_for_the_cooldown_only():
    table, clock = table_of("a")
    a = table.get("a")
    a.polled(SERVING, clock.now_s)
    a.mark_failed(clock.now_s, cooldown_s=5)
    assert states(table) == {"a": COOLING_DOWN} and table.serving_count() == 0
    clock.now_s += 5
    assert states(table) == {"a": SERVING} and table.serving_count() == 1
