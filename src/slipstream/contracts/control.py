"""The agent's gRPC control API (``slipstream.control.v1.Control``, see control.proto).

    operator rebalancer --ControlClient.stats()--> gRPC :50051 --> ControlService
        --> engine.stats() (a snapshot the engine thread refreshes; no locking)
    operator rebalancer --set_pool()--> ServingMetrics.set_pool (the label on new requests)

Messages come from the checked-in ``control_pb2`` (protoc output); the service and client are
written here against grpcio's generic handlers, so no ``_pb2_grpc`` module is needed and the
gRPC runtime version is not pinned by generated code. The server runs on its own small thread
pool, independent of the HTTP event loop: a stuck HTTP loop does not silence the stats, and a
slow stats caller cannot delay a token.
"""

from __future__ import annotations

from concurrent import futures
from typing import Protocol

import grpc
from google.protobuf.message import Message

from slipstream.contracts import control_pb2 as pb
from slipstream.contracts.control_auth import ControlToken, ControlTokenCheck, bearer_metadata

SERVICE_NAME = "slipstream.control.v1.Control"
POOLS = ("short", "long", "unified")


class EngineLoad(Protocol):
    """The fields of the engine's EngineStats that the control API reports. Declared here,
    not imported, so the operator can use this module's client without the engine (torch).
    Read-only, as EngineStats is frozen."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def kv_blocks_used(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def num_preemptions_total(self) -> int: ...

    @property
    def backlog_prompt_tokens(self) -> int: ...

    @property
    def utilization(self) -> float: ...

    @property
    def prefill_tokens_per_s(self) -> float: ...

    @property
    def slo_deviation(self) -> float: ...

    @property
    def queue_backlog_s(self) -> float: ...

    @property
    def first_tokens(self) -> int: ...

    @property
    def ttft_met(self) -> int: ...

    @property
    def finished(self) -> int: ...

    @property
    def tpot_met(self) -> int: ...

    @property
    def prefill_load(self) -> float: ...


class StatsSource(Protocol):
    """What the control API reads from the serving engine (AsyncEngine satisfies it)."""

    healthy: bool

    @property
    def model_name(self) -> str: ...

    def stats(self) -> EngineLoad: ...


class PoolHolder(Protocol):
    """ServingMetrics: the pool label that new requests' metrics carry."""

    @property
    def pool(self) -> str: ...

    def set_pool(self, pool: str) -> None: ...


class ControlService:
    def __init__(self, engine: StatsSource, pool_holder: PoolHolder) -> None:
        self._engine = engine
        self._pool_holder = pool_holder

    def health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(healthy=bool(self._engine.healthy), model=self._engine.model_name)

    def stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        stats = self._engine.stats()
        return pb.StatsResponse(
            healthy=bool(self._engine.healthy), model=self._engine.model_name,
            pool=self._pool_holder.pool, num_waiting=stats.num_waiting,
            num_running=stats.num_running, backlog_prompt_tokens=stats.backlog_prompt_tokens,
            queue_backlog_seconds=stats.queue_backlog_s, slo_deviation=stats.slo_deviation,
            utilization=stats.utilization, kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            preemptions_total=stats.num_preemptions_total,
            prefill_tokens_per_second=stats.prefill_tokens_per_s,
            ttft_first_tokens=stats.first_tokens, ttft_met=stats.ttft_met,
            tpot_finished=stats.finished, tpot_met=stats.tpot_met,
            prefill_load=stats.prefill_load)

    def set_pool(self, request: pb.SetPoolRequest,
                 context: grpc.ServicerContext) -> pb.SetPoolResponse:
        if request.pool not in POOLS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pool must be one of {', '.join(POOLS)}; got {request.pool!r}")
        previous = self._pool_holder.pool
        self._pool_holder.set_pool(request.pool)
        return pb.SetPoolResponse(previous_pool=previous, pool=request.pool)


# method name -> (request type, response type, ControlService attribute)
_METHODS: dict[str, tuple[type[Message], type[Message], str]] = {
    "Health": (pb.HealthRequest, pb.HealthResponse, "health"),
    "Stats": (pb.StatsRequest, pb.StatsResponse, "stats"),
    "SetPool": (pb.SetPoolRequest, pb.SetPoolResponse, "set_pool"),
}


def generic_handler(service: ControlService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        method: grpc.unary_unary_rpc_method_handler(
            getattr(service, attribute), request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString)
        for method, (request_type, response_type, attribute) in _METHODS.items()})


def start_control_server(service: ControlService, host: str, port: int,
                         token: ControlToken | None = None) -> tuple[grpc.Server, int]:
    """Serve on ``host:port`` (port 0: any free port); returns the server and its port. With
    ``token``, every call must present it (control_auth.py); without, the port is open."""
    interceptors: list[grpc.ServerInterceptor] = \
        [ControlTokenCheck(token)] if token is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2,
                                                    thread_name_prefix="slipstream-control"),
                         interceptors=interceptors)
    server.add_generic_rpc_handlers((generic_handler(service),))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound_port = server.add_insecure_port(address)
    if bound_port == 0:
        raise OSError(f"cannot bind the control API to {address}")
    server.start()
    return server, bound_port


class ControlClient:
    """Blocking client of one agent's control API (the operator calls it from a thread)."""

    def __init__(self, target: str, timeout_s: float = 2.0, token: str | None = None) -> None:
        self._channel = grpc.insecure_channel(target)
        self._timeout_s = timeout_s
        self._metadata = bearer_metadata(token)
        self._calls = {
            method: self._channel.unary_unary(
                f"/{SERVICE_NAME}/{method}", request_serializer=request_type.SerializeToString,
                response_deserializer=response_type.FromString)
            for method, (request_type, response_type, _) in _METHODS.items()}

    def health(self) -> pb.HealthResponse:
        return self._calls["Health"](pb.HealthRequest(), timeout=self._timeout_s,
                                     metadata=self._metadata)

    def stats(self) -> pb.StatsResponse:
        return self._calls["Stats"](pb.StatsRequest(), timeout=self._timeout_s,
                                    metadata=self._metadata)

    def set_pool(self, pool: str) -> pb.SetPoolResponse:
        return self._calls["SetPool"](pb.SetPoolRequest(pool=pool), timeout=self._timeout_s,
                                      metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
