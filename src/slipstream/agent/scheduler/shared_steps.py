"""Short steps while applications share an instance: a prefill with slack takes small chunks.

    Scheduler.add / finish --> SharedSteps.note_add / note_finish   (who is active)
    Scheduler.schedule     --> SharedSteps.begin_step(now)
    Scheduler._pack_prefills --> chunk_limit_ms(request, now): None, or the request yields:
                                 packed after the others, only beside its own application's
                                 prefills --> PrefillBudget.chunk_for(..., chunk_limit_ms=...)

An iteration cannot be interrupted. A request of one application that arrives while another
application's 1,000-token chunk runs waits for that chunk to end, and a short prompt packed
into the same batch as that chunk gets its first token only when the whole batch ends. The
fair queue and LARS decide who is packed first; neither bounds how long the shared step runs,
so a tenant within its limits still sets the p99 of everyone else's time to first token.

While at least one *other* application is active, a request whose prefill is more than one
short step and whose slack covers a slower pace *yields*: it is packed after every other
request, only into a batch that holds no other application's prefill, and its chunk adds at
most ``fraction * target`` to the batch. Its prefill takes more, shorter steps; another
application's arrival waits for a short step instead of a long chunk, and that arrival's own
first token is computed in a batch the yielding request stays out of. It does not hold back
the queue behind it under FCFS or Justitia (their head-of-line rule): it is packed last, not
refused. "Covers" means its slack is at least its remaining prefill time times
``1 / fraction - 1`` (what short steps could add), so a request near its deadline keeps its
place and whole budgets. An application is active while it has requests in the scheduler
and for ``window_s`` after its last one arrived or left: arrivals are what a long step would
delay, and an application between two requests is still sending. A lone application keeps
the full budget, so its own throughput does not change.

This is Medha's space sharing, which lets a long request with slack yield part of the
budget, applied by slack to any request and only while someone else can be hurt.
"""

from __future__ import annotations

from slipstream.agent.scheduler.request import Request
from slipstream.agent.scheduler.urgency import UrgencyModel


class SharedSteps:
    def __init__(self, urgency: UrgencyModel, target_batch_time_ms: float, fraction: float,
                 window_s: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError("shared_step_fraction must be in (0, 1]")
        if window_s < 0:
            raise ValueError("shared_step_window_s must be >= 0")
        self.urgency = urgency
        self.enabled = fraction < 1.0
        self.limit_ms = target_batch_time_ms * fraction
        self.stretch = 1.0 / fraction - 1.0  # extra time a prefill takes in short steps
        self.window_s = window_s
        self._in_scheduler: dict[str, int] = {}  # application -> its requests in the scheduler
        self._last_seen_s: dict[str, float] = {}  # application -> its last arrival or finish
        self._active: frozenset[str] = frozenset()

    def note_add(self, request: Request, now_s: float) -> None:
        if self.enabled:
            app = request.app_id
            self._in_scheduler[app] = self._in_scheduler.get(app, 0) + 1
            self._last_seen_s[app] = max(now_s, self._last_seen_s.get(app, now_s))

    def note_finish(self, request: Request, now_s: float) -> None:
        if not self.enabled:
            return
        app = request.app_id
        count = self._in_scheduler.get(app, 0) - 1
        if count > 0:
            self._in_scheduler[app] = count
        else:
            self._in_scheduler.pop(app, None)
        self._last_seen_s[app] = max(now_s, self._last_seen_s.get(app, now_s))

    def begin_step(self, now_s: float) -> None:
        """Settle which applications are active for this step (and forget quiet ones)."""
        if not self.enabled:
            return
        horizon = now_s - self.window_s
        quiet = [app for app, seen in self._last_seen_s.items()
                 if seen < horizon and app not in self._in_scheduler]
        for app in quiet:
            del self._last_seen_s[app]
        self._active = frozenset(self._in_scheduler).union(self._last_seen_s)

    def chunk_limit_ms(self, request: Request, now_s: float) -> float | None:
        """The most a chunk of ``request`` may add to a batch's time when it yields, or None
        for the full budget in the policy's order (no other application active, a prefill
        that is one short step anyway, or no slack to spare)."""
        if not self.enabled or not self._active - {request.app_id}:
            return None
        remaining_s = self.urgency.remaining_prefill_s(request)
        if remaining_s * 1000.0 <= self.limit_ms:
            return None  # its whole prefill is a short step already
        if self.urgency.slack_s(request, now_s) < remaining_s * self.stretch:
            return None
        return self.limit_ms
