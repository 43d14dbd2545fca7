"""The engine loop: wires tokenizer, scheduler, block manager and model runner.

One step is: schedule, execute, update, then turn sampled tokens into text and decide which
requests are finished (EOS, stop tokens, stop strings, max_tokens, the context limit).
Finished and aborted requests give their KV blocks back before the next step is scheduled.

This class is synchronous and single-threaded; ``AsyncEngine`` runs it on a background thread
for the HTTP server.

A step can run nothing while requests are unfinished: with short-prefill batching (AWD) the
scheduler holds new short prompts until their group is due. ``idle_wait_s`` then says how long
the caller may wait for a new request before stepping again (until the scheduler's wakeup),
so neither loop spins.

The engine talks to its model runner through the ``Runner`` protocol (runner.py). With one
process it builds the in-process ``ModelRunner`` itself; with ``tp x spp x kvp > 1`` the
caller passes a ``ParallelExecutor`` (worker processes behind ZeroMQ), which
``slipstream.agent.parallel.compose.build_engine`` does, so this module never imports
``agent/parallel``. Requests that leave are ``release``d to the runner. Under SPP the loop
keeps several batches in flight (``_step_pipelined``): a prefill chunk that samples nothing
is marked computed as soon as it is sent, so its next chunk can enter stage 1 right behind
it, while a chunk that samples (the last prefill chunk, a decode) marks its request
``in_flight`` and the scheduler leaves that request alone until the token is back
(pipeline.py keeps that bookkeeping).

Beside this module: parts.py chooses the context length, runner and scheduler config;
outputs.py turns each sampled token into text, a finish reason and the ``RequestOutput``;
disagg_requests.py is the per-request side of the prefill and decode roles; offline.py runs
the warm-up request and offline ``generate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from slipstream.agent.engine import offline, parts
from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.disagg_requests import DisaggRequests, require
from slipstream.agent.engine.errors import (
    KV_TRANSFER_FAILED, REQUEST_FAILED, EngineDeadError, KVTierLoadError)
from slipstream.agent.engine.sampling.grammar import GrammarCompiler, MaskJob, MaskWorkers
from slipstream.agent.engine.step.isolation import REQUEST_FAILED_MESSAGE, isolate_failures
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.step.load_window import LoadWindow
from slipstream.agent.engine.step.model_runner import SampledToken
from slipstream.agent.engine.step.outputs import (
    OutputState, error_output, final_output, step_output)
from slipstream.agent.engine.step.pipeline import InFlightBatches
from slipstream.agent.engine.step.runner import Runner
from slipstream.agent.engine.sampling.params import RequestOutput, SamplingParams
from slipstream.agent.engine.step.stats import EngineStats, StepStats
from slipstream.agent.engine.tokenizer import TextStream, Tokenizer
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.request import FinishReason, Request, RequestSLO, RequestStatus
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from slipstream.agent.engine.disagg import Disaggregation

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
        self._mask_workers: MaskWorkers | None = None  # started with the first grammar
        self._outputs: dict[str, OutputState] = {}
        self._ids = itertools.count()
        self.load = LoadWindow(start_s=self.clock())
        # Called on the engine thread after each executed batch (metrics); keep it cheap.
        self.on_step: Callable[[StepStats], None] | None = None
        self._in_flight = InFlightBatches()  # pipelined execution (SPP)
        self.last_step_ran_nothing = False  # nothing sent and nothing in flight
        # Prefill/decode disaggregation (disagg_requests.py): None in the mixed role.
        self._disagg: DisaggRequests | None = self._make_disagg(config)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def disagg(self) -> Disaggregation | None:
        """The prefill or decode role's transfers (disagg.py); None in the mixed role."""
        return self._disagg.disagg if self._disagg is not None else None

    def _make_disagg(self, config: EngineConfig) -> DisaggRequests | None:
        if not config.disagg.enabled:
            return None
        from slipstream.agent.engine.disagg import Disaggregation  # zmq, transfer engines

        kv_caches = getattr(self.runner, "kv_caches", None)
        if kv_caches is None:
            raise ValueError(f"--role {config.disagg.role} needs the in-process model runner")
        return DisaggRequests(
            Disaggregation(config.disagg, kv_caches, self.block_manager, self.clock))

    # -- requests ---------------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(self.model_config.vocab_size, self.max_model_len,
                             self.block_manager.kv_blocks_total)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a user-facing message if the request can never be served."""
        self.limits.validate(prompt_token_ids, params)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *, app_id: str = "default",
                    priority: int = 0, slo: RequestSLO | None = None,
                    kv_transfer: dict | None = None,
                    share_prompt_with: str | None = None, share_weight: float = 1.0) -> str:
        """Queue a request. ``kv_transfer`` (disaggregation, see disagg.py) is
        ``{"do_remote_decode": true}`` on a prefill instance, or the handle a prefill instance
        returned (with ``"do_remote_prefill": true``) on a decode instance.
        ``share_prompt_with`` names a request just added with the same prompt (another choice
        of an ``n > 1`` request): this one waits for its prefill and reuses that KV."""
        self.validate(prompt_token_ids, params)
        matcher = self.grammar.matcher(params.grammar) if params.grammar is not None else None
        request_id = request_id or f"req-{next(self._ids)}"
        now = self.clock()
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids),
            max_tokens=params.max_tokens, arrival_s=now, app_id=app_id, priority=priority,
            slo=slo or RequestSLO(), sampling=params.options(),
            share_prompt_with=share_prompt_with, share_weight=share_weight)
        if kv_transfer and kv_transfer.get("do_remote_prefill"):
            # Decode role: joins the scheduler once its KV has arrived (``_poll_disagg``).
            require(self._disagg, "do_remote_prefill", "decode").open_import(
                request, kv_transfer, self.model_config.vocab_size, self.scheduler.requests)
        else:
            if kv_transfer and kv_transfer.get("do_remote_decode"):
                require(self._disagg, "do_remote_decode", "prefill").open_export(request)
            self.scheduler.add(request)
            # Prefill work arriving here (a remote-prefilled request brings its KV instead).
            self.load.record_arrival(now, len(prompt_token_ids))
        self._outputs[request_id] = OutputState(
            params=params, text=TextStream(self.tokenizer, prompt_token_ids, params.stop),
            arrival_s=now, matcher=matcher)
        return request_id

    def _poll_disagg(self) -> list[RequestOutput]:
        """Free acknowledged exports; admit requests whose KV has arrived (their first
        token is the first output here) and fail those whose transfer failed."""
        if self._disagg is None:
            return []
        now = self.clock()
        outputs: list[RequestOutput] = []
        for request, arrived in self._disagg.arrivals(now, self.model_config.vocab_size,
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
        if self._disagg is not None:
            item = self._disagg.cancel_import(request_id)
            if item is not None:  # its blocks are freed when its transfer ends
                state = self._outputs.pop(request_id, None)
                if state is None:
                    return None
                item.request.status = RequestStatus.FINISHED
                item.request.finish_reason = reason
                output = final_output(item.request, state, [], "", error=error)
                output.error_code = error_code
                return output
            self._disagg.end_export(request_id)
        request = self.scheduler.finish(request_id, reason, self.clock())
        state = self._outputs.pop(request_id, None)
        if request is not None:
            self.runner.release((request_id,))
        if request is None or state is None:
            return None
        output = final_output(request, state, [], "", error=error)
        output.error_code = error_code
        return output

    def kv_handle(self, request_id: str) -> dict | None:
        """Prefill role: the streaming KV handle of a request still prefilling here (a
        decode instance given it reads each chunk's blocks as they are computed)."""
        return self._disagg.kv_handles.get(request_id) if self._disagg is not None else None

    def handle_output(self, request_id: str) -> RequestOutput | None:
        """Prefill role: the output a serving loop sends right after adding a request whose
        KV goes to a decode instance: no tokens, not finished, its streaming handle in
        ``kv_transfer``. It lets a router start the decode leg while the prompt computes;
        the final output still carries the complete handle (same hold)."""
        handle = self.kv_handle(request_id)
        request = self.scheduler.requests.get(request_id)
        if handle is None or request is None:
            return None
        return RequestOutput(request_id=request_id, new_token_ids=[], new_text="",
                             num_prompt_tokens=request.prompt_len, num_output_tokens=0,
                             kv_transfer=handle)

    def drop_kv(self, transfer_id: str) -> None:
        """Prefill role: free a hold handed off already (a stop string found after the
        engine finished the request, by the API process of a two-process server); a
        decode instance reading it is told it is gone."""
        if self._disagg is not None:
            self._disagg.drop_kv(transfer_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (
            self.disagg is not None and self.disagg.num_pending > 0)

    def stats(self) -> EngineStats:
        transfers: dict[str, float] = {}
        if self._disagg is not None:
            transfers.update(self._disagg.transfer_stats())
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
        if self._mask_workers is not None:
            self._mask_workers.close()
        disagg = getattr(self, "_disagg", None)  # None too if __init__ failed before it
        if disagg is not None:
            disagg.disagg.close()
            self._disagg = None
        self.runner.close()

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a worker process is gone (cheap; call when idle)."""
        self.runner.check_alive()

    def step(self) -> list[RequestOutput]:
        if self._disagg is not None:
            arrived = self._poll_disagg()
            return arrived + self._step()
        return self._step()

    def poll_transfers(self) -> list[RequestOutput]:
        """While idle: free KV that decode instances acknowledged (prefill role)."""
        return self._poll_disagg()

    def _step(self) -> list[RequestOutput]:
        if self.block_manager.tiers is not None:  # fetches from disk that ended
            self.scheduler.apply_tier_results(self.runner.poll_kv_tiers(), self.clock())
        if self.pipeline_depth > 1:
            return self._step_pipelined()
        schedule_start_s = self.clock()
        batch = self.scheduler.schedule(schedule_start_s)
        self.last_step_ran_nothing = batch.is_empty
        if batch.is_empty:
            return []
        execute_start_s = self.clock()
        sampled, failures = self._execute(batch)
        now = self.clock()
        self.load.record_step(schedule_start_s, now, batch.num_tokens - batch.num_decodes)
        if self.on_step is not None:
            self.on_step(StepStats(batch, schedule_start_s, execute_start_s, now,
                                   self.runner.last_forward_s))
        return self._apply(batch, sampled, failures, now)

    def _execute(self, batch: Batch) -> tuple[dict[str, SampledToken], dict[str, str]]:
        """Run the batch; if it raises, find the requests that make it fail (isolation.py).
        Returns the sampled tokens and ``{request_id: why}`` for requests to fail alone."""
        try:
            sampled = self._run(batch)
            failures: dict[str, str] = {}
        except KVTierLoadError as error:
            # Their KV did not arrive: recompute them, run the rest as it was.
            dropped = set(self.scheduler.recompute_after_failed_load(error.device_blocks,
                                                                     self.clock()))
            log.warning("%s; recomputing %d requests instead", error, len(dropped))
            rest = tuple(chunk for chunk in batch.chunks if chunk.request_id not in dropped)
            return self._execute(Batch(chunks=rest)) if rest else ({}, {})
        except EngineDeadError:
            raise
        except Exception as error:  # noqa: BLE001 - find the culprit, spare the rest
            log.warning("an engine step of %d requests failed (%s: %s); looking for the "
                        "request that causes it", len(batch.chunks), type(error).__name__, error)
            sampled, failures = isolate_failures(
                lambda chunks: self._run(Batch(chunks=chunks)), batch.chunks, error)
        return sampled, failures

    def _run(self, batch: Batch) -> dict[str, SampledToken]:
        """Execute one batch; the masks of its guided rows are computed while it runs."""
        masks = self._mask_job(batch.chunks)
        if masks is None:
            return self.runner.execute(batch)
        return self.runner.execute(batch, masks)

    def _mask_job(self, chunks: Sequence[ScheduledChunk]) -> MaskJob | None:
        """Start the grammar masks of the chunks that sample under a grammar; their rows
        are their places among the sampling chunks, as the runner orders them."""
        rows = []
        row = 0
        for chunk in chunks:
            if not chunk.sample:
                continue
            if chunk.sampling.guided:
                state = self._outputs.get(chunk.request_id)
                if state is not None and state.matcher is not None:
                    rows.append((row, state.matcher))
            row += 1
        if not rows:
            return None
        if self._mask_workers is None:
            self._mask_workers = MaskWorkers(self.grammar.lltokenizer.vocab_size)
        return self._mask_workers.start(rows)

    def _apply(self, batch: Batch, sampled: dict[str, SampledToken], failures: dict[str, str],
               now: float) -> list[RequestOutput]:
        """Fail the requests that could not be run or sampled, then advance the rest."""
        failures = {**failures, **{rid: s.error for rid, s in sampled.items() if s.error}}
        outputs = [out for rid, why in failures.items() if (out := self._fail(rid, why))]
        tokens = {rid: s.token_id for rid, s in sampled.items() if rid not in failures}
        self.scheduler.update(batch, tokens, now)
        if self._disagg is not None and self._disagg.exporting:
            self._disagg.publish(batch, failures, self.scheduler.requests)
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

    def _step_pipelined(self) -> list[RequestOutput]:
        """Send a batch if the pipeline has room, then take the results that are back."""
        runner = self.runner
        sent = False
        if runner.num_in_flight < self.pipeline_depth:
            schedule_start_s = self.clock()
            batch = self.scheduler.schedule(schedule_start_s)
            if not batch.is_empty:
                self._dispatch(batch, schedule_start_s)
                sent = True
        self.last_step_ran_nothing = not sent and runner.num_in_flight == 0
        if runner.num_in_flight == 0:
            return []
        # Wait only when nothing more could be sent; otherwise just take what has arrived.
        block = not sent or runner.num_in_flight >= self.pipeline_depth
        return [output for seq, sampled in runner.collect(block=block)
                for output in self._complete(seq, sampled)]

    def _dispatch(self, batch: Batch, schedule_start_s: float) -> None:
        execute_start_s = self.clock()
        masks = self._mask_job(batch.chunks)
        seq = self.runner.submit(batch) if masks is None else self.runner.submit(batch, masks)
        self._in_flight.sent(seq, batch, self.scheduler.requests, schedule_start_s,
                             execute_start_s)
        # A chunk that samples nothing needs no result: the next chunk may follow it now.
        advanced = tuple(chunk for chunk in batch.chunks if not chunk.sample)
        if advanced:
            self.scheduler.update(Batch(chunks=advanced), {}, self.clock())

    def _complete(self, seq: int, sampled: dict[str, SampledToken]) -> list[RequestOutput]:
        sent, current = self._in_flight.returned(seq, self.scheduler.requests, sampled)
        batch = sent.batch
        now = self.clock()
        # Pipelined batches overlap, so busy time is over-counted here; utilisation is
        # clamped to 1 by the load window, and the prefill rate stays a fair estimate.
        self.load.record_step(sent.execute_start_s, now, batch.num_tokens - batch.num_decodes)
        if self.on_step is not None:  # execute time here includes the wait in the pipeline
            self.on_step(StepStats(batch, sent.schedule_start_s, sent.execute_start_s, now,
                                   self.runner.last_forward_s))
        return self._apply(current, sampled, {}, now)

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
        kv_transfer = None
        if self._disagg is not None and request_id in self._disagg.exporting:
            # Prefill role: the first token ends the request here (its KV goes on).
            kv_transfer, reason = self._disagg.hand_off(request, now, reason)
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
        """Run one real one-token request through every rank and wait for its token, so that
        an instance says it is ready only once it has served. Raises ``EngineDeadError`` if a
        worker is gone, ``RuntimeError`` if the step fails or takes longer than
        ``timeout_s``. Leaves no trace: step observers are not told, and the load window
        starts afresh."""
        offline.warm_up(self, timeout_s)

    # -- offline use ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids of each, in order."""
        return offline.generate(self, prompts, params)

