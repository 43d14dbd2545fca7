"""Output-length predictors: how many tokens a request will still generate.

    Scheduler.add / finish --> LengthPredictor --> SRPT keys (TRAIL) and Justitia's KV cost

TRAIL predicts from intermediate-layer embeddings inside the model; that needs the engine, so
here the interface is pluggable and the default learns from finished requests: a running mean
of output lengths per application, capped by the request's ``max_tokens``.
"""

from __future__ import annotations

from typing import Protocol

from slipstream.agent.scheduler.request import Request


class LengthPredictor(Protocol):
    def predict_output_tokens(self, request: Request) -> int:
        """Total output tokens the request is expected to produce (>= 1)."""
        ...

    def observe(self, request: Request) -> None:
        """Learn from a finished request."""
        ...


class RunningMeanLengthPredictor:
    """Mean output length of the application's finished requests (a prior until then)."""

    def __init__(self, prior_tokens: int = 256, prior_weight: int = 1) -> None:
        if prior_tokens < 1 or prior_weight < 0:
            raise ValueError("prior_tokens must be >= 1 and prior_weight >= 0")
        self.prior_tokens = prior_tokens
        self.prior_weight = prior_weight
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def mean_output_tokens(self, app_id: str) -> float:
        total = self._sums.get(app_id, 0.0) + self.prior_tokens * self.prior_weight
        count = self._counts.get(app_id, 0) + self.prior_weight
        return total / count if count else float(self.prior_tokens)

    def predict_output_tokens(self, request: Request) -> int:
        guess = round(self.mean_output_tokens(request.app_id))
        return max(1, min(request.max_tokens, guess))

    def observe(self, request: Request) -> None:
        app = request.app_id
        self._sums[app] = self._sums.get(app, 0.0) + request.num_output_tokens
        self._counts[app] = self._counts.get(app, 0) + 1
