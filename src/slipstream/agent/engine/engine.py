"""The engine loop: wires tokenizer, scheduler, block manager and model runner.

One step is: schedule, execute, update, then turn sampled tokens into text and decide which
requests are finished (EOS, stop tokens, stop strings, max_tokens, the context limit).
Finished and aborted requests give their KV blocks back before the next step is scheduled.

This class is synchronous and single-threaded; ``EngineLoop`` (engine_loop.py) drives it for
the HTTP server, on a thread of the server's process or in an engine-core process.

A step can run nothing while requests are unfinished: with short-prefill batching (AWD) the
scheduler holds new short prompts until their group is due. ``idle_wait_s`` then says how long
the caller may wait for a new request before stepping again (until the scheduler's wakeup),
so neither loop spins.

The engine talks to its model runner through the ``Runner`` protocol (runner.py). With one
process it builds the in-process ``ModelRunner`` itself; with ``tp x spp x kvp > 1`` the
caller passes a ``ParallelExecutor`` (worker processes behind ZeroMQ), which
``slipstream.agent.parallel.compose.build_engine`` does, so this module never imports
``agent/parallel``. Requests that leave are ``release``d to the runner.

Beside this module: parts.py chooses the context length, runner and scheduler config;
execution.py runs a batch (grammar masks, failure isolation); pipeline.py keeps several
batches in flight under SPP; outputs.py turns each sampled token into text, a finish reason
and the ``RequestOutput``; roles/ is the instance's role (mixed, prefill or decode), which the
engine calls through one hook object (``self.role``); offline.py runs the warm-up request
and offline ``generate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from slipstream.contracts.request import EngineRequest
from slipstream.agent.engine import offline, parts
from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.errors import KV_TRANSFER_FAILED, REQUEST_FAILED
from slipstream.agent.engine.execution import BatchExecution
from slipstream.agent.engine.sampling.grammar import GrammarCompiler
from slipstream.agent.engine.step.isolation import REQUEST_FAILED_MESSAGE
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.agent.engine.step.batch_io import SampledToken
from slipstream.agent.engine.step.outputs import (
    OutputState, error_output, final_output, step_output)
from slipstream.agent.engine.step.pipeline import PipelinedSteps
from slipstream.agent.engine.roles.base import Role, make_role
from slipstream.agent.engine.step.runner import Runner
from slipstream.agent.engine.sampling.params import RequestOutput
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.engine.step.stats import EngineStats, StepStats
from slipstream.agent.engine.tokenizer import Tokenizer
from slipstream.agent.engine.detokenizer import TextStream
from slipstream.agent.scheduler.batch import Batch
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import FinishReason, Request, RequestStatus
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)
# After a step that ran nothing while no wakeup time is known (nothing held, nothing runnable,
# e.g. a request waiting for KV blocks), retry after this long rather than at once.
STALLED_RETRY_S = 0.001


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 runner: Runner | None = None, output_text: bool = True) -> None:
        self.config = config = parts.with_scheduler(config, scheduler_config)
        # False in an engine-core process: the API process turns tokens into text and checks
        # stop strings (agent/server/engine_core.py); outputs then carry no text.
        self.output_text = output_text
        self.clock = clock
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.max_model_len = parts.max_model_len(config, self.model_config)
        # The runner sizes its KV cache to hold at least one request of the resolved length.
        self.runner: Runner = runner or parts.make_runner(
            dataclasses.replace(config, max_model_len=self.max_model_len), self.model_config)
        self.pipeline_depth = self.runner.pipeline_depth
        scheduler_config = parts.scheduler_config(config)
        # Swap preemption needs somewhere to put the blocks: a host pool as large as the
        # device one, so that any preempted request fits.
        num_host_blocks = self.runner.num_kv_blocks if scheduler_config.preemption == "swap" else 0
        if num_host_blocks:
            try:
                self.runner.allocate_host_cache(num_host_blocks)
            except ValueError:
                self.close()
                raise
        scheduler_config, predictor = parts.fit_packer(config, scheduler_config)
        tier_config = None
        if config.kv_tiers.enabled and scheduler_config.prefix_caching:
            try:
                tier_config = parts.enable_kv_tiers(self.runner, config, predictor)
            except ValueError:
                self.runner.close()
                raise
        self.block_manager = BlockManager(self.runner.num_kv_blocks, num_host_blocks,
                                          prefix_caching=scheduler_config.prefix_caching,
                                          tiers=tier_config)
        self.scheduler = Scheduler(scheduler_config, self.block_manager, predictor=predictor)
        if config.profile_dir is None:
            log.info("packer: a fixed budget of %d tokens per iteration (no runtime profile)",
                     scheduler_config.max_batched_tokens)
        else:
            log.info("packer: time budget of %g ms per iteration, runtime profile %s",
                     scheduler_config.target_batch_time_ms, config.profile_dir)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.model_config.eos_token_ids)
        self.grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                       self.eos_token_ids)
        self._outputs: dict[str, OutputState] = {}
        self.execution = BatchExecution(self.runner, self.scheduler,
                                        self.grammar.lltokenizer.vocab_size, self._matcher_of,
                                        self.clock)
        self._ids = itertools.count()
        self.load = LoadWindow(start_s=self.clock())
        # Called on the engine thread after each executed batch (metrics); keep it cheap.
        self.on_step: Callable[[StepStats], None] | None = None
        self._pipeline = PipelinedSteps(self.runner, self.scheduler, self.execution,
                                        self.clock) if self.pipeline_depth > 1 else None
        self.last_step_ran_nothing = False  # nothing sent and nothing in flight
        # Prefill/decode disaggregation (roles/): this instance's part in it, if any.
        self.role: Role = make_role(config.disagg, self.runner, self.block_manager, self.clock)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    # -- requests ---------------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len,
                             self.block_manager.kv_blocks_total)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request can never be served."""
        self.limits.validate(prompt_token_ids, params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, **fields: Any) -> str:
        """Offline use: queue a request of these tokens; ``fields`` are the rest of
        ``EngineRequest`` (``slo``, ``kv_transfer``, ...). Returns its id."""
        return self.add(EngineRequest(request_id or f"req-{next(self._ids)}",
                                      list(prompt_token_ids), params, **fields))

    def add(self, spec: EngineRequest) -> str:
        """Queue a request (ValueError if it can never be served here). ``kv_transfer``
        (disaggregation, see roles/) asks a prefill instance to hand the KV off, or a
        decode instance to fetch it from the prefill instance its handle names.
        ``share_prompt_with`` names a request just added with the same prompt (another choice
        of an ``n > 1`` request): this one waits for its prefill and reuses that KV."""
        params = spec.params
        self.validate(spec.prompt_token_ids, params)
        matcher = self.grammar.matcher(params.grammar) if params.grammar is not None else None
        now = self.clock()
        request = Request(spec, now)
        # Decode role: a request whose KV comes from elsewhere joins the scheduler once the
        # KV has arrived (``_admit_arrivals``).
        if not self.role.admit(request, spec.kv_transfer, self.model_config.vocab_size,
                               self.scheduler.requests):
            self.scheduler.add(request)
            # Prefill work arriving here (a remote-prefilled request brings its KV instead).
            self.load.record_arrival(now, len(spec.prompt_token_ids))
        self._outputs[spec.request_id] = OutputState(
            params=params, text=TextStream(self.tokenizer, spec.prompt_token_ids, params.stop),
            arrival_s=now, matcher=matcher)
        return spec.request_id

    def _admit_arrivals(self) -> list[RequestOutput]:
        """Admit requests whose KV has arrived from elsewhere (their first token is the first
        output here) and fail those whose transfer failed."""
        now = self.clock()
        outputs: list[RequestOutput] = []
        for request, arrived in self.role.arrivals(now, self.model_config.vocab_size,
                                                   self._outputs):
            if not arrived:
                output = final_output(request, self._outputs.pop(request.request_id), [], "",
                                      error="the KV cache of this request could not be "
                                            "fetched from its prefill instance")
                output.error_code = KV_TRANSFER_FAILED
                outputs.append(output)
                continue
            self.scheduler.add_running(request, now)
            first = self._process(request.request_id,
                                  SampledToken(request.output_token_ids[-1]), now)
            if first is not None:
                outputs.append(first)
        return outputs

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None, error_code: str | None = None) -> RequestOutput | None:
        kept = self.role.cancel(request_id)
        if kept is not None:  # its blocks are freed when its transfer ends
            state = self._outputs.pop(request_id, None)
            if state is None:
                return None
            kept.status = RequestStatus.FINISHED
            kept.finish_reason = reason
            output = final_output(kept, state, [], "", error=error)
            output.error_code = error_code
            return output
        request = self.scheduler.finish(request_id, reason, self.clock())
        state = self._outputs.pop(request_id, None)
        if request is not None:
            self.runner.release((request_id,))
        if request is None or state is None:
            return None
        output = final_output(request, state, [], "", error=error)
        output.error_code = error_code
        return output

    def handle_output(self, request_id: str) -> RequestOutput | None:
        """The output a serving loop sends right after adding a request, if its role
        announces one (the prefill role's streaming KV handle, ``Role.handle_output``)."""
        request = self.scheduler.requests.get(request_id)
        return None if request is None else self.role.handle_output(request)

    def drop_kv(self, transfer_id: str) -> None:
        """Prefill role: free a hold handed off already (``Role.drop_kv``)."""
        self.role.drop_kv(transfer_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.role.num_pending > 0

    def stats(self) -> EngineStats:
        transfers: dict[str, float] = dict(self.role.transfer_stats())
        if self.block_manager.tiers is not None:
            transfers.update(self.runner.kv_tier_counters())
        return EngineStats.of(
            self.scheduler, self.load.snapshot(self.clock()), self._kvp_active_degree(),
            transfers)

    def _kvp_active_degree(self) -> int:
        """KVP groups the widest running request's KV spans (progressive KVP)."""
        group_tokens = self.scheduler.config.kvp_tokens_per_group
        if self.config.parallel.kvp == 1 or group_tokens is None:
            return 1
        widest = max((r.num_computed_tokens for r in self.scheduler.running), default=0)
        return max(1, -(-widest // group_tokens))

    # -- the loop ---------------------------------------------------------------------------

    def idle_wait_s(self) -> float:
        """How long the caller may wait for a new request before the next ``step``: 0 after a
        step that ran something; after one that ran nothing, until the scheduler's next wakeup
        (AWD releases held short prefills then), or ``STALLED_RETRY_S`` if it has none."""
        if not self.last_step_ran_nothing:
            return 0.0
        now = self.clock()
        wakeup_s = self.scheduler.next_wakeup_s(now)
        if wakeup_s is None:
            return STALLED_RETRY_S
        return max(0.0, wakeup_s - now)

    def close(self) -> None:
        """Stop worker processes, if any (the in-process runner has nothing to stop)."""
        execution = getattr(self, "execution", None)  # None if __init__ failed before it
        if execution is not None:
            execution.close()
        role = getattr(self, "role", None)  # None if __init__ failed before it
        if role is not None:
            role.close()
        self.runner.close()

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a worker process is gone (cheap; call when idle)."""
        self.runner.check_alive()

    def step(self) -> list[RequestOutput]:
        return self._admit_arrivals() + self._step()

    def poll_transfers(self) -> list[RequestOutput]:
        """While idle: free KV that decode instances acknowledged (prefill role)."""
        return self._admit_arrivals()

    def _step(self) -> list[RequestOutput]:
        if self.block_manager.tiers is not None:  # fetches from disk that ended
            self.scheduler.apply_tier_results(self.runner.poll_kv_tiers(), self.clock())
        if self._pipeline is not None:
            return self._step_pipelined(self._pipeline)
        schedule_start_s = self.clock()
        batch = self.scheduler.schedule(schedule_start_s)
        self.last_step_ran_nothing = batch.is_empty
        if batch.is_empty:
            return []
        execute_start_s = self.clock()
        sampled, failures = self.execution.execute(batch)
        now = self.clock()
        self._record_step(batch, schedule_start_s, execute_start_s, now)
        return self._apply(batch, sampled, failures, now)

    def _record_step(self, batch: Batch, schedule_start_s: float, execute_start_s: float,
                     now: float) -> None:
        # Pipelined batches overlap, so busy time is over-counted there; utilisation is
        # clamped to 1 by the load window, and the prefill rate stays a fair estimate. Their
        # execute time includes the wait in the pipeline.
        self.load.record_step(execute_start_s if self._pipeline else schedule_start_s, now,
                              batch.num_tokens - batch.num_decodes)
        if self.on_step is not None:
            self.on_step(StepStats(batch, schedule_start_s, execute_start_s, now,
                                   self.runner.last_forward_s))

    def _matcher_of(self, request_id: str) -> Any:
        state = self._outputs.get(request_id)
        return None if state is None else state.matcher

    def _apply(self, batch: Batch, sampled: dict[str, SampledToken], failures: dict[str, str],
               now: float) -> list[RequestOutput]:
        """Fail the requests that could not be run or sampled, then advance the rest."""
        failures = {**failures, **{rid: s.error for rid, s in sampled.items() if s.error}}
        outputs = [out for rid, why in failures.items() if (out := self._fail(rid, why))]
        tokens = {rid: s.token_id for rid, s in sampled.items() if rid not in failures}
        self.scheduler.update(batch, tokens, now)
        self.role.published(batch, failures, self.scheduler.requests)
        for request_id in tokens:
            try:
                output = self._process(request_id, sampled[request_id], now)
            except Exception as error:  # noqa: BLE001 - output handling of one request
                output = self._fail(request_id, f"{type(error).__name__}: {error}")
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, request_id: str, why: str) -> RequestOutput | None:
        """End one request with an error; the cause goes to the log, not to the client."""
        log.error("request %s failed in the engine: %s", request_id, why)
        known = request_id in self._outputs
        output = self.abort(request_id, FinishReason.ERROR, REQUEST_FAILED_MESSAGE,
                            REQUEST_FAILED)
        if output is None and known:  # its output handling broke half-way: still answer it
            output = error_output(request_id, REQUEST_FAILED_MESSAGE, REQUEST_FAILED)
        return output

    def _step_pipelined(self, pipeline: PipelinedSteps) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for sent, current, sampled in pipeline.step():
            now = self.clock()
            self._record_step(sent.batch, sent.schedule_start_s, sent.execute_start_s, now)
            outputs += self._apply(current, sampled, {}, now)
        self.last_step_ran_nothing = pipeline.ran_nothing
        return outputs

    def _process(self, request_id: str, sampled: SampledToken, now: float) -> RequestOutput | None:
        request = self.scheduler.requests.get(request_id)
        state = self._outputs.get(request_id)
        if request is None or state is None:
            return None
        if state.first_token_s is None:
            state.first_token_s = now
            if request.slo.ttft_s is not None:
                self.load.record_first_token(now, now - state.arrival_s, request.slo.ttft_s)
        token, params = sampled.token_id, state.params
        if sampled.logprob is not None:
            state.logprobs.append(sampled.logprob)
        is_stop_token = (token in self.eos_token_ids and not params.ignore_eos) or (
            token in params.stop_token_ids)
        if not is_stop_token and state.matcher is not None and \
                not state.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected sampled token {token}: "
                               f"{state.matcher.get_error()}")
        at_length = request.num_output_tokens >= params.max_tokens or \
            request.num_tokens >= self.max_model_len
        text, reason = state.advance(token, stop_token=is_stop_token, at_length=at_length,
                                     with_text=self.output_text)
        new_tokens = request.output_token_ids[state.emitted_tokens:]
        state.emitted_tokens = request.num_output_tokens
        # Prefill role: the first token ends a handed-off request here (its KV goes on).
        kv_transfer, reason = self.role.hand_off(request, now, reason)
        if reason is not None:
            outputs = request.num_output_tokens
            if request.slo.tpot_s is not None and outputs > 1 and state.first_token_s is not None:
                self.load.record_finish(now, (now - state.first_token_s) / (outputs - 1),
                                        request.slo.tpot_s)
            self.scheduler.finish(request_id, reason, now)
            self.runner.release((request_id,))
            del self._outputs[request_id]
            output = final_output(request, state, new_tokens, text)
            output.kv_transfer = kv_transfer
            output.stop_token = is_stop_token
            return output
        logprobs, state.logprobs = state.logprobs, []
        return step_output(request, new_tokens, text, logprobs)

    def warm_up(self, timeout_s: float = offline.WARM_UP_TIMEOUT_S) -> None:
        """Serve one real one-token request before saying ready (``offline.warm_up``)."""
        offline.warm_up(self, timeout_s)

    # -- offline use ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids of each, in order."""
        return offline.generate(self, prompts, params)

