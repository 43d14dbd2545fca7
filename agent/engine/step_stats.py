"""What one executed engine step looked like, handed to the optional ``LLMEngine.on_step``
observer (the agent's metrics) right after the batch ran.

    LLMEngine.step(): schedule -> execute -> StepStats -> on_step(stats) -> update

Times are engine-clock readings, not durations, so that building one costs nothing beyond the
clock reads the step makes anyway; the observer reads ``batch`` itself. Pure data, no torch:
the metrics layer and its tests import it without the model stack.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.agent.scheduler.batch import Batch


@dataclass(frozen=True, slots=True)
class StepStats:
    batch: Batch
    schedule_start_s: float  # before Scheduler.schedule()
    execute_start_s: float  # after it, before ModelRunner.execute()
    execute_end_s: float  # after execute() returned the sampled tokens
    forward_s: float  # the model forward inside the execution (ModelRunner.last_forward_s)

    @property
    def schedule_s(self) -> float:
        return self.execute_start_s - self.schedule_start_s

    @property
    def execute_s(self) -> float:
        return self.execute_end_s - self.execute_start_s
