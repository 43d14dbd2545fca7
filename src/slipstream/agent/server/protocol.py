"""Wire types of the OpenAI-compatible API: what clients send (the answers are in
``responses.py``).

    HTTP JSON body -> CompletionRequest / ChatCompletionRequest (validated here)
        -> SamplingParams + prompt tokens (server/prepare.py) -> engine
    engine RequestOutput -> CompletionResponse / ChatCompletionResponse or stream chunks

Slipstream extensions travel as extra top-level JSON fields, which the official ``openai``
client sends through ``extra_body``:

    {"top_k": 20, "repetition_penalty": 1.1, "ignore_eos": true, "priority": 1,
     "app_id": "search", "slo": {"ttft_s": 2.0, "tpot_ms": 50}}

``slo`` is a nested object (the one scheme; no flat aliases). Without a tenants file,
``app_id`` names the application for fair queuing (else OpenAI's ``user``, else
``"default"``); with one, the API key names the tenant and ``app_id`` only a
sub-application inside it (tenancy/identity.py). Unknown fields are rejected
with a 400 naming them, as OpenAI does, so that a misspelt SLO is never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slipstream.contracts.sampling import MAX_LOGPROBS
from slipstream.agent.server.wire_values import check_wire_integers

MAX_STOP_SEQUENCES = 16
MAX_CHOICES = 16  # n: each choice is a request of its own in the engine


class _StrictModel(BaseModel):
    # Types are strict, as OpenAI's are: "10" or true is not a max_tokens, "yes" is not a
    # stream flag (an integer still passes for a float).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class SloSpec(_StrictModel):
    """Per-request objectives (absent: the engine's defaults); with tenants, ``class`` names a
    tenant's SLO class, never tighter than its tightest (tenancy/slo_policy.py)."""

    class_name: str | None = Field(default=None, alias="class", min_length=1, max_length=63)
    ttft_s: float | None = Field(default=None, gt=0, le=86_400)
    tpot_ms: float | None = Field(default=None, gt=0, le=600_000)


class KvReleaseRequest(_StrictModel):
    """``POST /v1/kv_transfer/release``: free a prefill instance's KV hold now."""

    transfer_id: str = Field(min_length=1, max_length=64, pattern=r"^[0-9a-f]+$")


class StreamOptions(_StrictModel):
    include_usage: bool = False


class _GenerationRequest(_StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # absent: the served model
    max_tokens: int | None = None  # absent: the rest of the context, capped by the server
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Slipstream extensions.
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-1_000_000, le=1_000_000)
    app_id: str | None = Field(default=None, min_length=1, max_length=256)
    slo: SloSpec | None = None
    # Prefill/decode disaggregation, as vLLM names it: {"do_remote_decode": true} asks a
    # prefill instance to keep the KV for a decode instance; the handle it answers with
    # (plus "do_remote_prefill": true) makes a decode instance fetch that KV and continue.
    # Streamed, a prefill leg's first event is the streaming handle (sse.py).
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        # OpenAI reads a null field as one left out ("stream": null is a plain request).
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _stream_options_need_a_stream(self) -> _GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("n")
    @classmethod
    def _bounded_choices(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are supported")
        return value

    @field_validator("kv_transfer_params")
    @classmethod
    def _kv_transfer_fits_the_wire(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # The handle crosses to the engine core as msgpack, which has 64-bit integers only;
        # a larger one failed there as a 500 (found by the schemathesis fuzz test).
        if value is not None:
            check_wire_integers(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), "
                                 f"got {key!r}")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), value) for key, value in (self.logit_bias or {}).items())

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. One prompt: a string or a list of token ids."""

    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> str | list[int]:
        """Accept a string, a token id list, or a batch of exactly one of those."""
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"batched prompts ({len(value)} in one request) are not "
                                 "supported; send one request per prompt")
            value = value[0]
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be empty")
            return value
        if not isinstance(value, list) or not all(
                isinstance(token, int) and not isinstance(token, bool) for token in value):
            raise ValueError("must be a string or a list of integer token ids")
        if not value:
            raise ValueError("must not be empty")
        if min(value) < 0:
            raise ValueError("token ids must be non-negative")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return value


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Clients echo assistant turns back with fields we do not use (refusal, annotations).
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JsonSchemaSpec(BaseModel):
    """``response_format.json_schema``: the schema every answer must satisfy."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """``text`` (the default), ``json_object`` (any JSON object) or ``json_schema``. The
    JSON formats are enforced by a grammar whatever ``strict`` says: a model cannot step
    outside them."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no arguments
    strict: bool | None = None


class ToolSpec(_StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(_StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. Text-only messages, formatted by the chat template."""

    messages: list[ChatMessage]
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> ChatCompletionRequest:
        names = {tool.function.name for tool in self.tools or []}
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, "
                                 "which is not in tools")
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if len(names) != len(self.tools or []):
            raise ValueError("tools must have distinct function names")
        return self

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: ``auto`` with tools, ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"
    max_completion_tokens: int | None = None  # the newer name of max_tokens; wins when both set
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        if not value:
            raise ValueError("must contain at least one message")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token for the engine: None when logprobs are off."""
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
