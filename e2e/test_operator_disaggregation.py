"""A disaggregated ServingReplica on the real control plane: the operator starts a prefill
and a decode instance with their roles and the chaining router; a request through the router
with the official openai client is prefilled on one pod and decoded on the other, and the
transfer metrics of both agents show the KV moving between them.

    ServingReplica (disaggregation: 1 prefill + 1 decode) --operator--> 2 agent pods
      (--role prefill / --role decode, pool label unified / decode) + router Deployment
    openai client --> router pod IP --prefill leg--> prefill pod (KV held)
                                      --decode leg--> decode pod (pulls the KV over the
                                        Mooncake Transfer Engine, acknowledges)

Services have no endpoints here (loopback pod IPs), so the test talks to the router's pod IP,
as the other operator tests do. Everything waits on conditions, not sleeps.
"""

from __future__ import annotations

import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from operator_env import POOL_LABEL, is_ready, pod_ip, replica_pods, servingreplica, wait_ready

pytestmark = pytest.mark.e2e

NAME = "split"
BACKEND_HEADER = "x-slipstream-backend"
PREFILL_HEADER = "x-slipstream-prefill-backend"
PROMPT = "Tell me about prefill and decode. " * 6  # several 16-token KV blocks


def ready_router(dev_cluster, namespace: str) -> dict | None:
    pods = dev_cluster.api.get(f"/api/v1/namespaces/{namespace}/pods",
                               query={"labelSelector": f"slipstream.dev/router={NAME}"})["items"]
    ready = [p for p in pods if is_ready(p) and not p["metadata"].get("deletionTimestamp")]
    return ready[0] if ready else None


def samples(pod: dict, name: str) -> dict[tuple, float]:
    """The agent's own /metrics: every sample of ``name``, by its label values."""
    text = urllib.request.urlopen(f"http://{pod_ip(pod)}:8000/metrics", timeout=10).read()
    return {tuple(sorted(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text.decode())
            for sample in family.samples if sample.name == name}


def transfers(pod: dict, outcome: str) -> float:
    return samples(pod, "slipstream_kv_transfers_total")[(("outcome", outcome),)]


def test_disaggregated_replica_serves_with_kv_moved_from_prefill_to_decode(
        dev_cluster, sr_namespace, tiny_model_dir):
    namespace = sr_namespace
    dev_cluster.apply(servingreplica(
        NAME, namespace, tiny_model_dir,
        disaggregation={"prefill": {"instances": 1}, "decode": {"instances": 1},
                        "blocksPerRead": 2}))
    replica = wait_ready(dev_cluster, namespace, NAME, "2/2")
    status = replica["status"]
    assert status["disaggregation"]["prefill"]["ready"] == "1/1"
    assert status["disaggregation"]["decode"]["ready"] == "1/1"
    assert sorted((i["role"], i["pool"]) for i in status["instances"]) == \
        [("decode", "decode"), ("prefill", "unified")]
    # The printer columns, as the API server renders them.
    table = dev_cluster.kubectl("get", "servingreplica", NAME, "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    # Columns are aligned by position (an empty one, like SHORT without pools, is blank).
    starts = [header.index(name) for name in header.split()] + [len(row)]
    columns = {name: row[start:end].strip()
               for name, start, end in zip(header.split(), starts, starts[1:])}
    assert (columns["PREFILL"], columns["DECODE"], columns["PHASE"]) == ("1/1", "1/1", "Ready")

    pods = {p["metadata"]["labels"][POOL_LABEL]: p
            for p in replica_pods(dev_cluster, namespace, NAME)}
    prefill, decode = pods["unified"], pods["decode"]
    for pod, role in ((prefill, "prefill"), (decode, "decode")):
        command = pod["spec"]["containers"][0]["command"]
        assert command[command.index("--role") + 1] == role
    router = dev_cluster.wait_for(lambda: ready_router(dev_cluster, namespace), 90,
                                  "the router pod Ready")
    acknowledged_before = transfers(prefill, "acknowledged")
    completed_before = transfers(decode, "completed")

    client = openai.OpenAI(base_url=f"http://{pod_ip(router)}:8000/v1", api_key="unused",
                           max_retries=0, timeout=60)

    def chained():
        """One chat completion; its response once the router chained it (until the router
        has seen the decode pod Ready, a prefill instance serves requests whole)."""
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            temperature=0.0, extra_body={"ignore_eos": True})
        return raw if raw.headers.get(PREFILL_HEADER) else None

    raw = dev_cluster.wait_for(chained, 60, "a request chained through both roles")
    answer = raw.parse()
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 8
    assert raw.headers[PREFILL_HEADER] == prefill["metadata"]["name"]
    assert raw.headers[BACKEND_HEADER] == decode["metadata"]["name"]

    # The decode agent fetched the prompt's KV (blocks and bytes) and completed the transfer;
    # the prefill agent freed its copy on the acknowledgement.
    assert transfers(decode, "completed") >= completed_before + 1
    assert transfers(decode, "failed") == 0
    blocks = samples(decode, "slipstream_kv_transfer_blocks_total")
    assert blocks[(("source", "transferred"),)] > 0
    assert samples(decode, "slipstream_kv_transfer_bytes_total")[()] > 0
    dev_cluster.wait_for(lambda: transfers(prefill, "acknowledged") >= acknowledged_before + 1,
                         30, "the prefill agent to count the acknowledgement")
    # The roles stay apart: nothing was transferred into the prefill instance.
    assert samples(prefill, "slipstream_kv_transfer_blocks_total")[(("source", "transferred"),)] \
        == 0
