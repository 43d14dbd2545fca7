"""The router's HTTP front door: an OpenAI-compatible proxy in front of the pools.

    client --POST /v1/completions, /v1/chat/completions--> classify (prompt tokens)
        --> Proxy.forward --> Dispatcher (pool, least backlog, fair queue) --> agent
    client --GET /v1/models--> the first instance that answers
    kubelet --GET /health--> 200 while some instance serves (and each one's state)
    Prometheus --GET /metrics--> RouterMetrics
    people --GET /router/instances--> the membership and load the router sees (JSON)

Startup wires the moving parts: static backends or the pod watch fill the InstanceTable, the
stats poller reads each agent's /metrics, and one httpx client carries all upstream traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request

from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.router.classify import CHAT, COMPLETIONS, LengthClassifier
from slipstream.agent.router.config import RouterConfig
from slipstream.agent.router.disagg import DisaggChain, chainable
from slipstream.agent.router.dispatcher import Dispatcher
from slipstream.agent.router.instances import BackendSpec, InstanceTable
from slipstream.agent.router.metrics import RouterMetrics
from slipstream.agent.router.pod_discovery import PodWatcher
from slipstream.agent.router.proxy import BACKEND_HEADER, Proxy, forwarded_headers
from slipstream.agent.router.stats_poller import StatsPoller
from slipstream.agent.router.tenants import scoped_body, scoped_request
from slipstream.contracts.errors import APIError, add_openai_error_handlers
from slipstream.agent.server.limits import parse_json, read_body
from slipstream.agent.server.tenancy.gate import TenancyGate
from slipstream.agent.server.tenancy.identity import caller_of
from slipstream.agent.server.tenancy.registry import OPEN_LABEL, Tenants

log = logging.getLogger(__name__)
# Bodies larger than this are tokenized off the event loop (a 1M-token prompt takes ~1 s).
INLINE_TOKENIZE_MAX_BYTES = 64 * 1024
# Below the agents' own keep-alive timeout (server/cli.py AGENT_KEEPALIVE_S).
UPSTREAM_KEEPALIVE_S = 10.0


class Router:
    """The router's state, reachable from tests as ``app.state.router``."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.table = InstanceTable()
        self.metrics = RouterMetrics()
        self.dispatcher = Dispatcher(self.table, config, self.metrics)
        self.classifier = LengthClassifier(tokenizer, config.long_prefill_threshold_tokens,
                                           config.prefix_block_tokens or None)
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self.chain: DisaggChain | None = None
        self.poller: StatsPoller | None = None
        self.watcher: PodWatcher | None = None

    async def start(self) -> None:
        # Idle connections are dropped well before an agent would close them (its
        # keep-alive timeout is longer): otherwise a request sent on a connection the agent
        # is closing at that instant is lost, and such a request is not retried.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=UPSTREAM_KEEPALIVE_S))
        self.proxy = Proxy(self.config, self.dispatcher, self.client, self.metrics)
        self.chain = DisaggChain(self.proxy, self.table)
        for backend in self.config.static_backends:
            self.table.upsert(BackendSpec(name=backend.url, url=backend.url.rstrip("/"),
                                          pool=backend.pool, instance=backend.url))
        if self.config.kubernetes is not None:
            self.watcher = PodWatcher(self.config.kubernetes, self.table,
                                      asyncio.get_running_loop())
            self.watcher.start()
        self.poller = StatsPoller(self.table, self.client, self.config.stats_interval_s,
                                  self.config.unhealthy_cooldown_s)
        self.poller.start()

    async def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.poller is not None:
            await self.poller.stop()
        if self.client is not None:
            await self.client.aclose()

    async def route(self, request: Request, path: str, endpoint: str) -> Response:
        raw = await read_body(request, self.config.max_body_bytes,
                              self.config.request_read_timeout_s)
        body = parse_json(raw)  # bad JSON is refused here, in OpenAI's shape
        caller = caller_of(request.scope)
        if caller is not None and isinstance(body, dict):
            scoped = scoped_body(caller, body)  # 403 for another tenant's app_id
            if scoped is not None:
                raw, body = scoped, json.loads(scoped)
        if len(raw) > INLINE_TOKENIZE_MAX_BYTES:
            routed = await asyncio.to_thread(self.classifier.classify, endpoint, body)
        else:
            routed = self.classifier.classify(endpoint, body)
        if caller is not None:
            routed = scoped_request(caller, routed)  # 429 past tokens per minute
        self.table.observe_prompt(routed.request_class, routed.prompt_tokens)
        if self.proxy is None or self.chain is None:
            raise RuntimeError("a request reached the router before its start-up")
        headers = forwarded_headers(request.headers)
        if self.table.has_decode_instances() and chainable(body):
            return await self.chain.forward(path, endpoint, body, headers, routed, request)
        return await self.proxy.forward(path, raw, headers, routed)

    def instances_view(self) -> list[dict]:
        mean = self.table.mean_prompt_tokens
        return [{"name": i.name, "url": i.spec.url, "pool": i.pool, "instance": i.spec.instance,
                 "in_flight": i.in_flight, "own_in_flight": i.own_in_flight,
                 "predicted_backlog_tokens": i.predicted_backlog_tokens(
                     self.config.decode_weight_tokens,
                     mean("long" if i.pool == "long" else "short")),
                 "kv_capacity_tokens": i.kv_capacity_tokens}
                for i in sorted(self.table, key=lambda i: i.name)]


def build_router_app(config: RouterConfig, tokenizer: Tokenizer | None = None) -> FastAPI:
    router = Router(config, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="Slipstream router", summary="Length-aware pool router (OpenAI API)",
                  lifespan=lifespan)
    app.state.router = router
    _add_error_handlers(app)
    tenants = None if config.tenants_path is None else Tenants(config.tenants_path)
    router.metrics.create_tenant_series(tenants.metric_labels() if tenants else [OPEN_LABEL])
    app.add_middleware(TenancyGate, tenants=tenants, count=router.metrics.count_tenant_request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "/v1/completions", COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.route(request, "/v1/chat/completions", CHAT)

    @app.get("/v1/models")
    async def models() -> Response:
        assert router.client is not None, "the lifespan started the router"
        for instance in router.table.candidates("short"):
            try:
                upstream = await router.client.get(f"{instance.spec.url}/v1/models", timeout=5)
            except httpx.TransportError:
                continue
            if upstream.status_code == 200:
                return Response(upstream.content, media_type="application/json",
                                headers={BACKEND_HEADER: instance.name})
        raise APIError(503, "no serving instance answered", code="no_instance_available")

    @app.get("/health")
    async def health() -> Response:
        """Ready (200) while at least one instance serves by the stats poller's last look;
        503 when none does. ``instances`` counts only those; ``backends`` lists every
        instance the router knows with its state (serving, not_serving, late, unresponsive,
        cooling_down, unknown), the reason and how long ago it last answered a poll."""
        serving = router.table.serving_count()
        body = {"status": "ok" if serving else "no instances", "instances": serving,
                "known_instances": len(router.table), "backends": router.table.health_view()}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = router.metrics.exposition(router.table, router.dispatcher.queue_depth,
                                         config.decode_weight_tokens)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/instances")
    async def instances() -> Response:
        return Response(json.dumps({"instances": router.instances_view()}, indent=1),
                        media_type="application/json")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    add_openai_error_handlers(app, "Unknown endpoint. The Slipstream router serves "
                              "/v1/completions, /v1/chat/completions, /v1/models, /health, "
                              "/metrics and /router/instances.")
