"""How a request samples: ``SamplingParams`` (what the client asked for, validated once at
the API edge) and ``SamplingOptions`` (the part the runner needs per token).

The scheduler only sees ``SamplingOptions``; stop strings, stop tokens and ``max_tokens`` are
applied by the engine's output processor. Pure data: the scheduler, the engine and both
transports between the API and the engine share these types.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """What the runner needs to sample a request's next token. Pure data."""

    temperature: float = 1.0
    top_k: int = -1  # -1 disables
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # number of top alternatives; None = no logprobs
    # OpenAI's penalties on tokens already generated, and the multiplicative repetition
    # penalty (1 disables) on the prompt and generated tokens, as vLLM and transformers apply it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # The request is constrained by a grammar: the engine supplies each step's token mask.
    guided: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_output_history(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_prompt_history(self) -> bool:
        return self.repetition_penalty != 1.0


MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
# Integers cross to the sampler (and, with parallel workers, over msgpack) as int64.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return per token; 0 = only the chosen
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), at most one per token
    # An llguidance grammar (engine/grammar.py) every output must match: structured outputs
    # and forced tool calls. The request ends when the grammar is complete.
    grammar: str | None = None

    def __post_init__(self) -> None:
        errors = self.validation_errors()
        if errors:
            raise ValueError("; ".join(errors))

    def validation_errors(self) -> list[str]:
        errors = []
        if self.max_tokens < 1:
            errors.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            errors.append(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            errors.append(f"top_k must be -1 (disabled) or in [1, {INT64_MAX}], got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            errors.append(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        if any(not 0 <= token <= INT64_MAX for token in self.stop_token_ids):
            errors.append("stop_token_ids must be non-negative token ids")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            errors.append(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            errors.append("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                errors.append(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            errors.append(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            errors.append(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                          f"got {len(self.logit_bias)}")
        if any(not 0 <= token <= INT64_MAX for token, _ in self.logit_bias):
            errors.append("logit_bias keys must be non-negative token ids")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            errors.append("logit_bias values must be in [-100, 100]")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            errors.append("logit_bias names a token more than once")
        return errors

    def options(self) -> SamplingOptions:
        return SamplingOptions(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                               seed=self.seed, logprobs=self.logprobs,
                               presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty,
                               repetition_penalty=self.repetition_penalty,
                               logit_bias=self.logit_bias, guided=self.grammar is not None)
