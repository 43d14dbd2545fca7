"""The HTTP front door of one serving instance: ``build_app(engine)`` returns the FastAPI app.

    client --HTTP--> routes here --> completions.py / chat.py --> engine.generate()
    Prometheus --GET /metrics--> metrics.py (engine.stats() read at scrape time)
    kubelet probes --GET /health--> engine.healthy

Request bodies are parsed by hand rather than by FastAPI's signature binding, so every
problem (malformed JSON, a wrong field, an unknown model) comes back as a 4xx in OpenAI's
error shape, never FastAPI's 422, and nothing a client sends can take the server down.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from slipstream.contracts.request import RequestSLO
from slipstream.agent.server.chat import create_chat_completion
from slipstream.agent.server.completions import create_completion
from slipstream.agent.server.config import ServerConfig
from slipstream.contracts.errors import (
    APIError, add_openai_error_handlers, bad_request, error_response, from_validation_error)
from slipstream.agent.server.generation import ClientDisconnected
from slipstream.agent.server.limits import parse_json, read_body
from slipstream.agent.server.metrics import ServingMetrics
from slipstream.agent.server.prepare import ServingContext
from slipstream.agent.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                              KvReleaseRequest)
from slipstream.agent.server.responses import ModelCard, ModelList
from slipstream.agent.server.tenancy.gate import TenancyGate
from slipstream.agent.server.tenancy.registry import OPEN_LABEL, Tenants

if TYPE_CHECKING:
    from slipstream.agent.engine.engine_client import ServingEngine

M = TypeVar("M", bound=BaseModel)
# nginx's code for "client closed request": logged, never seen by the (gone) client.
STATUS_CLIENT_CLOSED_REQUEST = 499


def build_app(engine: ServingEngine, config: ServerConfig | None = None, *,
              manage_engine: bool = True) -> FastAPI:
    """The app for ``engine``. With ``manage_engine`` the app starts and stops the engine."""
    config = config or ServerConfig()
    tpot_s = None if config.slo_tpot_ms is None else config.slo_tpot_ms / 1000.0
    metrics = ServingMetrics(engine.stats, pool=config.pool,
                             long_prompt_threshold_tokens=config.long_prompt_threshold_tokens,
                             default_slo=RequestSLO(ttft_s=config.slo_ttft_s, tpot_s=tpot_s),
                             attainment_target=config.slo_attainment_target)
    # Per-iteration metrics; set before the engine thread starts, read only by it.
    engine.set_step_observer(metrics.step_metrics)
    ctx = ServingContext(engine=engine, metrics=metrics, config=config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            # Ready means serving: the engine answers a real one-token request through every
            # rank before uvicorn opens the port and /health says ok.
            await engine.start(warm_up=True)
        try:
            yield
        finally:
            if manage_engine:
                await engine.shutdown()

    app = FastAPI(title="Slipstream", summary="OpenAI-compatible LLM serving",
                  lifespan=lifespan)
    app.state.serving = ctx
    _add_error_handlers(app)
    tenants = None if config.tenants_path is None else Tenants(config.tenants_path)
    metrics.create_tenant_series(tenants.metric_labels() if tenants else [OPEN_LABEL])
    app.add_middleware(TenancyGate, tenants=tenants, count=metrics.count_tenant_request,
                       on_clamped=metrics.count_slo_clamped)

    @app.get("/health")
    async def health() -> Response:
        # Ready means serving: true only after the engine ran a real request through every
        # rank (the warm-up at start-up), and false again once it drains or loses a worker.
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        status = "draining" if engine.draining else "unhealthy"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        card = ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse_body(request, CompletionRequest, config)
        _require_healthy(ctx)
        return await _answer(create_completion(ctx, request, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse_body(request, ChatCompletionRequest, config)
        _require_healthy(ctx)
        return await _answer(create_chat_completion(ctx, request, body))

    @app.post("/v1/kv_transfer/release")
    async def release_kv(request: Request) -> Response:
        """Prefill role: free a KV hold that no decode instance will read, now rather than
        at the hold timeout (the router, when a chain's decode leg found no decode
        instance). The transfer id is the capability: random, known only to the router
        and the decode instance it was handed to."""
        body = await _parse_body(request, KvReleaseRequest, config)
        engine.release_kv(body.transfer_id)
        return JSONResponse({"transfer_id": body.transfer_id, "released": True})

    _describe_request_bodies(app, {"/v1/completions": CompletionRequest,
                                   "/v1/chat/completions": ChatCompletionRequest,
                                   "/v1/kv_transfer/release": KvReleaseRequest})
    return app


def _describe_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Put the request bodies into the app's OpenAPI document (/openapi.json). The handlers
    parse bodies themselves (for OpenAI-shaped errors), so FastAPI cannot see them; clients
    and fuzzers (schemathesis, in the tests) read them from here."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        document = default_openapi()
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            document["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]


async def _answer(handler: Awaitable[Response]) -> Response:
    try:
        return await handler
    except ClientDisconnected:
        return Response(status_code=STATUS_CLIENT_CLOSED_REQUEST)


def _require_healthy(ctx: ServingContext) -> None:
    if ctx.engine.draining:
        raise APIError(503, "this instance is shutting down; retry on another instance",
                       code="draining")
    if not ctx.engine.healthy:
        raise APIError(503, "the engine is not healthy; retry on another instance",
                       code="engine_unavailable")


async def _parse_body(request: Request, model_type: type[M], config: ServerConfig) -> M:
    raw = await read_body(request, config.max_body_bytes, config.request_read_timeout_s)
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model_type.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None


def _add_error_handlers(app: FastAPI) -> None:
    add_openai_error_handlers(app, "Unknown endpoint. Slipstream serves /v1/completions, "
                              "/v1/chat/completions, /v1/models, /v1/kv_transfer/release, /health "
                              "and /metrics.")

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(bad_request(str(error)))
