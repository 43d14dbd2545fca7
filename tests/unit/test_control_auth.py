"""The control port's bearer token against a real gRPC server on loopback, with a stand-in
engine: SetPool, Stats and Health without, with a wrong, a repeated or the right token
(issue 30). tests/server/test_tenants_attacks.py does the same against `slipstream serve`."""

from __future__ import annotations

from dataclasses import dataclass

import time

import grpc
import pytest

from slipstream.contracts import control_pb2 as pb
from slipstream.contracts.control import (
    SERVICE_NAME, ControlClient, ControlService, start_control_server)
from slipstream.contracts.control_auth import ControlToken, derive_control_token

TOKEN = "t" * 48


@dataclass
class _Load:
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 8
    num_preemptions_total: int = 0
    backlog_prompt_tokens: int = 0
    utilization: float = 0.0
    prefill_tokens_per_s: float = 0.0
    slo_deviation: float = 0.0
    queue_backlog_s: float = 0.0
    first_tokens: int = 0
    ttft_met: int = 0
    finished: int = 0
    tpot_met: int = 0
    prefill_load: float = 0.0


class _Engine:
    healthy = True
    model_name = "stand-in"

    def stats(self) -> _Load:
        return _Load()


class _Pool:
    def __init__(self) -> None:
        self.pool = "short"

    def set_pool(self, pool: str) -> None:
        self.pool = pool


@pytest.fixture
def control(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    holder = _Pool()
    server, port = start_control_server(ControlService(_Engine(), holder), "127.0.0.1", 0,
                                        ControlToken(token_file))
    yield f"127.0.0.1:{port}", holder, token_file
    server.stop(grace=0)


@pytest.mark.parametrize("token", [None, "wrong-" + "x" * 40, TOKEN[:-1], TOKEN + "x"])
def test_set_pool_without_the_right_token_is_refused_and_changes_nothing(control, token):
    target, holder, _ = control
    with ControlClient(target, token=token) as client:
        for call in (lambda: client.set_pool("long"), client.stats, client.health):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert holder.pool == "short"


def test_a_repeated_or_non_bearer_authorization_is_refused(control):
    target, holder, _ = control
    with grpc.insecure_channel(target) as channel:
        set_pool = channel.unary_unary(f"/{SERVICE_NAME}/SetPool",
                                       request_serializer=pb.SetPoolRequest.SerializeToString,
                                       response_deserializer=pb.SetPoolResponse.FromString)
        for metadata in ((("authorization", f"Bearer {TOKEN}"),
                          ("authorization", f"Bearer {TOKEN}")),
                         (("authorization", f"Basic {TOKEN}"),),
                         (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as refused:
                set_pool(pb.SetPoolRequest(pool="long"), timeout=5, metadata=metadata)
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert holder.pool == "short"


def test_the_right_token_works_and_a_rotated_file_takes_over(control, monkeypatch):
    target, holder, token_file = control
    with ControlClient(target, token=TOKEN) as client:
        assert client.set_pool("long").previous_pool == "short"
        assert client.health().healthy
    assert holder.pool == "long"
    rotated = "r" * 48
    token_file.write_text(rotated)
    deadline = time.monotonic() + 10
    while True:  # the file is looked at again at most once a second
        with ControlClient(target, token=rotated) as client:
            try:
                client.health()
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the rotated token never took over"
                time.sleep(0.1)
    with ControlClient(target, token=TOKEN) as client, pytest.raises(grpc.RpcError):
        client.health()


def test_replica_tokens_are_derived_per_replica_and_refused_when_short(tmp_path):
    master = b"m" * 32
    token = derive_control_token(master, "serving", "chat")
    assert token == derive_control_token(master, "serving", "chat")
    assert token != derive_control_token(master, "serving", "chat2") != \
        derive_control_token(master, "other", "chat")
    assert len(token) == 64
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ValueError, match="shorter than 32"):
        ControlToken(short)
