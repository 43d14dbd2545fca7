"""A rolling update on the real control plane: changing a ServingReplica's spec (a new image)
replaces both instances one at a time under steady load from the openai client through
`slipstream router`, and not one request fails.

    ServingReplica "roll", 2 instances (tp 1) --spec.image changes--> template hash differs
      operator: surge a third instance from the new spec --Ready--> drain the oldest (its
        controller pod leaves role=controller: the router's watch drops it) --idle--> delete
        (the agent's SIGTERM drain) --> next outdated instance, the same way
    closed-loop clients (completions and streamed chat) --> router --> Ready agents

Services get no endpoints here (loopback pod IPs; e2e/README.md), so the clients go through
a real router that finds the controller pods through the pod watch, as the operator's own
router does for pooled replicas. Every wait is on a condition, never a fixed sleep.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from operator_env import ClosedLoopLoad, events, get_replica, replica_pods, router_process, \
    servingreplica, timed, wait_ready

pytestmark = pytest.mark.e2e

NAME = "roll"
HASH_LABEL = "slipstream.dev/template-hash"
BACKEND_HEADER = "x-slipstream-backend"
ROLLOUT_TIMEOUT_S = 600.0  # two instances started, drained and deleted, on a loaded box


class Load(ClosedLoopLoad):
    """Closed-loop openai clients through the router: plain completions (the backend that
    served each is read from the router's header) and streamed chat completions."""

    def __init__(self, base_url: str, clients: int) -> None:
        self.clients = [openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                      timeout=120) for _ in range(clients)]
        super().__init__(clients, self._one)

    def _one(self, k: int, turn: int) -> str | None:
        client = self.clients[k]
        return self._stream(client, k, turn) if k % 2 else self._complete(client, k, turn)

    @staticmethod
    def _complete(client: openai.OpenAI, k: int, turn: int) -> str | None:
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=f"client {k} turn {turn}: once upon a time", max_tokens=8)
        answer = raw.parse()
        assert answer.choices[0].finish_reason in ("length", "stop"), answer
        return raw.headers.get(BACKEND_HEADER)

    @staticmethod
    def _stream(client: openai.OpenAI, k: int, turn: int) -> None:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"client {k} turn {turn}"}],
            max_tokens=16, stream=True)
        finish = [chunk.choices[0].finish_reason for chunk in stream if chunk.choices]
        assert finish and finish[-1] in ("length", "stop"), finish
        return None


def router_backends(base_url: str) -> set[str] | None:
    """The pods in the router's rotation; None when it did not answer in time."""
    try:
        view = httpx.get(f"{base_url}/router/instances", timeout=5).json()
    except (httpx.TransportError, ValueError):
        return None
    return {entry["name"] for entry in view["instances"]}


def test_a_spec_change_replaces_both_instances_one_at_a_time_with_no_failed_request(
        dev_cluster, sr_namespace, tiny_model_dir, tmp_path):
    namespace = sr_namespace
    dev_cluster.apply(servingreplica(NAME, namespace, tiny_model_dir, instances=2,
                                     drainTimeoutSeconds=30))
    wait_ready(dev_cluster, namespace, NAME, "2/2", timeout_s=300)
    old_pods = {p["metadata"]["name"]: p["metadata"]["labels"][HASH_LABEL]
                for p in replica_pods(dev_cluster, namespace, NAME)}
    assert len(old_pods) == 2 and len(set(old_pods.values())) == 1

    with router_process(dev_cluster, namespace, NAME, tmp_path / "router.log") as router:
        base = f"http://{router}"
        dev_cluster.wait_for(lambda: router_backends(base) == set(old_pods), 120,
                             "the router to see both instances")
        with Load(f"{base}/v1", clients=4) as load:
            dev_cluster.wait_for(lambda: load.served_by == set(old_pods), 120,
                                 "load served by both old instances")
            served_before = load.ok
            with timed("spec change -> both instances replaced, Ready 2/2") as timer:
                dev_cluster.kubectl("patch", "servingreplica", NAME, "-n", namespace,
                                    "--type", "merge", "-p",
                                    '{"spec": {"image": "slipstream-agent:e2e-next"}}')

                fewest_backends = [len(old_pods)]
                every_pod = set(old_pods)

                def rolled_out():
                    backends = router_backends(base)
                    if backends is not None and len(backends) < fewest_backends[0]:
                        fewest_backends[0] = len(backends)
                        print(f"[rotation] {time.strftime('%H:%M:%S')} {sorted(backends)}")
                    pods = replica_pods(dev_cluster, namespace, NAME, live=False)
                    names = {p["metadata"]["name"] for p in pods}
                    every_pod.update(names)
                    hashes = {p["metadata"]["labels"][HASH_LABEL] for p in pods}
                    replica = get_replica(dev_cluster, namespace, NAME) or {}
                    status = replica.get("status") or {}
                    done = (len(pods) == 2 and not names & set(old_pods)
                            and len(hashes) == 1 and hashes != set(old_pods.values())
                            and status.get("ready") == "2/2" and status.get("phase") == "Ready")
                    return names if done else None

                new_pods = dev_cluster.wait_for(rolled_out, ROLLOUT_TIMEOUT_S,
                                                "both instances replaced and Ready", 1.0)
            # The new instances take the traffic through the router.
            dev_cluster.wait_for(lambda: router_backends(base) == new_pods, 60,
                                 "the router to see only the new instances")
            dev_cluster.wait_for(lambda: new_pods <= load.served_by, 120,
                                 "requests served by both new instances")
        during = load.ok - served_before

    print(f"[measure] rolling update of 2 instances: {timer.elapsed_s:.1f} s, {load.ok} "
          f"requests ({during} from the spec change on), {len(load.failures)} failed; "
          f"fewest instances in the router's rotation: {fewest_backends[0]}")
    assert load.failures == [], load.failures[:5]
    assert during > 0
    assert fewest_backends[0] >= 1
    # Exactly one new instance per old one: none was torn down and created again.
    assert len(every_pod) == 4, sorted(every_pod)

    rolled = events(dev_cluster, namespace, "RollingUpdate")
    drained = events(dev_cluster, namespace, "InstanceDrained")
    for event in rolled + drained:
        print(f"[event] {event['reason']}: {event['message']}")
    # One at a time: each outdated instance was drained once, none timed out.
    assert len(rolled) == 2, [e["message"] for e in rolled]
    assert len(drained) == 2, [e["message"] for e in drained]
    assert not events(dev_cluster, namespace, "DrainTimedOut")
    assert not events(dev_cluster, namespace, "InstanceRestarted")
    replica = get_replica(dev_cluster, namespace, NAME)
    assert {c["type"]: c["status"] for c in replica["status"]["conditions"]} == {
        "Placed": "True", "Ready": "True", "Degraded": "False"}
