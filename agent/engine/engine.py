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
``in_flight`` and the scheduler leaves that request alone until the token is back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.errors import KV_TRANSFER_FAILED, REQUEST_FAILED, EngineDeadError
from slipstream.agent.engine.grammar import GrammarCompiler, MaskJob, MaskWorkers
from slipstream.agent.engine.isolation import REQUEST_FAILED_MESSAGE, isolate_failures
from slipstream.agent.engine.limits import RequestLimits
from slipstream.agent.engine.load_window import LoadWindow
from slipstream.agent.engine.model_runner import ModelRunner, SampledToken
from slipstream.agent.engine.runner import Runner
from slipstream.agent.engine.sampling_params import RequestOutput, SamplingParams, TokenLogprob
from slipstream.agent.engine.stats import EngineStats, StepStats
from slipstream.agent.engine.tokenizer import TextStream, Tokenizer
from slipstream.agent.scheduler.batch import Batch, ScheduledChunk
from slipstream.agent.scheduler.block_manager import BlockManager
from slipstream.agent.scheduler.config import fit_target_to_model
from slipstream.agent.scheduler.predictor import RuntimePredictor
from slipstream.agent.scheduler.request import FinishReason, Request, RequestSLO, RequestStatus
from slipstream.agent.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger(__name__)
# After a step that ran nothing while no wakeup time is known (nothing held, nothing runnable,
# e.g. a request waiting for KV blocks), retry after this long rather than at once.
STALLED_RETRY_S = 0.001
# The warm-up request (``warm_up``); a generous bound, for a loaded machine or a first CUDA call.
WARM_UP_REQUEST_ID = "slipstream-warm-up"
WARM_UP_TIMEOUT_S = 300.0


@dataclass
class _OutputState:
    """Per-request output bookkeeping that the scheduler does not need."""

    params: SamplingParams
    text: TextStream
    arrival_s: float
    first_token_s: float | None = None
    emitted_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    matcher: Any = None  # llguidance.LLMatcher of a request with a grammar

    def add_token(self, token_id: int) -> tuple[str, bool]:
        return self.text.add_token(token_id)

    def flush(self) -> str:
        return self.text.flush()


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler_config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 runner: Runner | None = None, output_text: bool = True) -> None:
        self.config = config
        # False in an engine-core process: the API process turns tokens into text and checks
        # stop strings (agent/server/engine_core.py); outputs then carry no text.
        self.output_text = output_text
        self.clock = clock
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.max_model_len = self._resolve_max_model_len()
        # The runner sizes its KV cache to hold at least one request of the resolved length.
        self.runner: Runner = runner or _make_runner(
            dataclasses.replace(config, max_model_len=self.max_model_len), self.model_config)
        self.pipeline_depth = self.runner.pipeline_depth
        scheduler_config = scheduler_config or SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_batched_tokens=config.max_batched_tokens)
        if config.parallel.kvp > 1 and scheduler_config.kvp_tokens_per_group is None:
            scheduler_config = dataclasses.replace(
                scheduler_config, kvp_tokens_per_group=config.parallel.kvp_tokens_per_group)
        # Swap preemption needs somewhere to put the blocks: a host pool as large as the
        # device one, so that any preempted request fits.
        num_host_blocks = self.runner.num_kv_blocks if scheduler_config.preemption == "swap" else 0
        if num_host_blocks:
            try:
                self.runner.allocate_host_cache(num_host_blocks)
            except ValueError:
                self.close()
                raise
        self.block_manager = BlockManager(self.runner.num_kv_blocks, num_host_blocks,
                                          prefix_caching=scheduler_config.prefix_caching)
        predictor = _load_predictor(config)
        if predictor is not None:
            scheduler_config, warning = fit_target_to_model(scheduler_config, predictor)
            if warning:
                log.warning("packer: %s", warning)
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
        self._outputs: dict[str, _OutputState] = {}
        self._ids = itertools.count()
        self.load = LoadWindow(start_s=self.clock())
        # Called on the engine thread after each executed batch (metrics); keep it cheap.
        self.on_step: Callable[[StepStats], None] | None = None
        # Pipelined execution: batch seq -> (batch, each request's preemption count at send,
        # clock readings for StepStats), and request id -> seq of the batch that will bring its
        # next token.
        self._dispatched: dict[int, tuple[Batch, dict[str, int], float, float]] = {}
        self._sampling_seq: dict[str, int] = {}
        self.last_step_ran_nothing = False  # nothing sent and nothing in flight
        # Prefill/decode disaggregation (engine/disagg.py): None in the mixed role.
        self.disagg = self._make_disagg(config)
        self._exporting: set[str] = set()  # prefill role: requests whose KV goes elsewhere
        self._kv_handles: dict[str, dict] = {}  # their streaming handles, until they end

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def _make_disagg(self, config: EngineConfig):
        if not config.disagg.enabled:
            return None
        from slipstream.agent.engine.disagg import Disaggregation  # zmq, transfer engines

        kv_caches = getattr(self.runner, "kv_caches", None)
        if kv_caches is None:
            raise ValueError(f"--role {config.disagg.role} needs the in-process model runner")
        return Disaggregation(config.disagg, kv_caches, self.block_manager, self.clock)

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # Without a sliding-window kernel, attention is exact only inside the window.
            limit = min(limit, self.model_config.sliding_window)
        parallel = self.config.parallel
        if parallel.kvp > 1:
            limit = min(limit, parallel.max_context_tokens)  # no KVP group beyond the last
        requested = self.config.max_model_len
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
        return requested or limit

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
                    share_prompt_with: str | None = None) -> str:
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
            share_prompt_with=share_prompt_with)
        if kv_transfer and kv_transfer.get("do_remote_prefill"):
            self._add_remote_prefilled(request, kv_transfer)
        else:
            if kv_transfer and kv_transfer.get("do_remote_decode"):
                if self.disagg is None or self.disagg.exports is None:
                    raise ValueError("kv_transfer_params.do_remote_decode needs a prefill "
                                     "instance (slipstream serve --role prefill)")
                self._exporting.add(request_id)
                self._kv_handles[request_id] = self.disagg.open_export(request).to_json()
            self.scheduler.add(request)
            # Prefill work arriving here (a remote-prefilled request brings its KV instead).
            self.load.record_arrival(now, len(prompt_token_ids))
        self._outputs[request_id] = _OutputState(
            params=params, text=TextStream(self.tokenizer, prompt_token_ids, params.stop),
            arrival_s=now, matcher=matcher)
        return request_id

    def _add_remote_prefilled(self, request: Request, kv_transfer: dict) -> None:
        """Decode role: fetch the prompt's KV from the prefill instance named in the handle;
        the request joins the scheduler once it has arrived (``_poll_disagg``)."""
        from slipstream.agent.engine.disagg import KVImport
        from slipstream.agent.engine.kv_transfer.transport import KVHandle

        if self.disagg is None or self.disagg.imports is None:
            raise ValueError("kv_transfer_params.do_remote_prefill needs a decode instance "
                             "(slipstream serve --role decode)")
        handle = KVHandle.from_json(kv_transfer)
        self.disagg.check_handle(handle, request.prompt_token_ids)
        if handle.first_token_id >= self.model_config.vocab_size:
            raise ValueError("kv_transfer_params.first_token_id is outside the vocabulary")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        # The first token joins the output once the KV is here (a streaming handle learns
        # it only then).
        request.num_computed_tokens = request.prompt_len
        self.disagg.imports.add(KVImport(request, handle))

    def _poll_disagg(self) -> list[RequestOutput]:
        """Free acknowledged exports; admit requests whose KV has arrived (their first
        token is the first output here) and fail those whose transfer failed."""
        disagg = self.disagg
        if disagg is None:
            return []
        now = self.clock()
        outputs: list[RequestOutput] = []
        for item in disagg.poll(now):
            request = item.request
            request_id = request.request_id
            request.block_ids = item.block_ids
            if item.cancelled or request_id not in self._outputs:
                self.block_manager.release(request.block_ids)
                continue
            if item.error is None and not 0 <= item.first_token_id < self.model_config.vocab_size:
                item.error = f"first token {item.first_token_id} is outside the vocabulary"
            if item.error is not None:
                log.error("request %s: KV transfer failed: %s", request_id, item.error)
                self.block_manager.release(request.block_ids)
                state = self._outputs.pop(request_id)
                request.status = RequestStatus.FINISHED
                request.finish_reason = FinishReason.ERROR
                output = self._final_output(request, state, [], "",
                                            error="the KV cache of this request could not be "
                                                  "fetched from its prefill instance")
                output.error_code = KV_TRANSFER_FAILED
                outputs.append(output)
                continue
            request.output_token_ids.append(item.first_token_id)
            self.scheduler.add_running(request, now)
            first = self._process(request_id, SampledToken(request.output_token_ids[-1]), now)
            if first is not None:
                outputs.append(first)
        return outputs

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None, error_code: str | None = None) -> RequestOutput | None:
        if self.disagg is not None and self.disagg.imports is not None:
            item = self.disagg.imports.cancel(request_id)
            if item is not None:  # its blocks are freed when its transfer ends
                state = self._outputs.pop(request_id, None)
                if state is None:
                    return None
                item.request.status = RequestStatus.FINISHED
                item.request.finish_reason = reason
                output = self._final_output(item.request, state, [], "", error=error)
                output.error_code = error_code
                return output
        self._end_export(request_id)
        request = self.scheduler.finish(request_id, reason, self.clock())
        state = self._outputs.pop(request_id, None)
        if request is not None:
            self.runner.release((request_id,))
        if request is None or state is None:
            return None
        output = self._final_output(request, state, [], "", error=error)
        output.error_code = error_code
        return output

    def kv_handle(self, request_id: str) -> dict | None:
        """Prefill role: the streaming KV handle of a request still prefilling here (a
        decode instance given it reads each chunk's blocks as they are computed)."""
        return self._kv_handles.get(request_id)

    def handle_output(self, request_id: str) -> RequestOutput | None:
        """Prefill role: the output a serving loop sends right after adding a request whose
        KV goes to a decode instance: no tokens, not finished, its streaming handle in
        ``kv_transfer``. It lets a router start the decode leg while the prompt computes;
        the final output still carries the complete handle (same hold)."""
        handle = self._kv_handles.get(request_id)
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
        if self.disagg is not None and self.disagg.exports is not None:
            self.disagg.exports.drop(transfer_id)

    def _end_export(self, request_id: str) -> None:
        """Prefill role: the request ends here; a hold it did not hand off is freed."""
        if request_id in self._exporting:
            self._exporting.discard(request_id)
            self._kv_handles.pop(request_id, None)
            assert self.disagg is not None
            self.disagg.drop(request_id)  # a no-op once exported

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (
            self.disagg is not None and self.disagg.num_pending > 0)

    def stats(self) -> EngineStats:
        load = self.load.snapshot(self.clock())
        backlog = sum(r.num_uncached_tokens for r in self.scheduler.requests.values()
                      if r.in_prefill)
        manager = self.block_manager
        return EngineStats(
            num_waiting=self.scheduler.num_waiting, num_running=self.scheduler.num_running,
            kv_blocks_used=manager.kv_blocks_used, kv_blocks_total=manager.kv_blocks_total,
            kv_blocks_cached=manager.kv_blocks_cached,
            prefix_cache_lookup_tokens=manager.prefix_lookup_tokens,
            prefix_cache_hit_tokens=manager.prefix_hit_tokens,
            prefix_cache_evictions=manager.prefix_evictions,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            kvp_active_degree=self._kvp_active_degree(),
            backlog_prompt_tokens=backlog, utilization=load.utilization,
            prefill_tokens_per_s=load.prefill_tokens_per_s, slo_deviation=load.slo_deviation,
            first_tokens=load.first_tokens, ttft_met=load.ttft_met, finished=load.finished,
            tpot_met=load.tpot_met,
            arrival_prompt_tokens_per_s=load.arrival_prompt_tokens_per_s,
            **self._transfer_stats())

    def _transfer_stats(self) -> dict[str, int]:
        disagg = self.disagg
        if disagg is None:
            return {}
        exports = disagg.exports
        return {
            "kv_transfers_acknowledged": exports.num_released_total if exports is not None else 0,
            "kv_transfers_expired": exports.num_expired_total if exports is not None else 0,
            "kv_transfers_completed": disagg.num_completed_total,
            "kv_transfers_failed": disagg.num_failed_total,
            "kv_transfer_blocks": disagg.num_blocks_transferred_total,
            "kv_transfer_cached_blocks": disagg.num_blocks_cached_total,
            "kv_transfer_bytes": disagg.num_bytes_transferred_total,
            "kv_transfer_overlapped_blocks": disagg.num_blocks_overlapped_total,
        }

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
        if getattr(self, "disagg", None) is not None:
            self.disagg.close()
            self.disagg = None
        self.runner.close()

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a worker process is gone (cheap; call when idle)."""
        self.runner.check_alive()

    def step(self) -> list[RequestOutput]:
        if self.disagg is not None:
            arrived = self._poll_disagg()
            return arrived + self._step()
        return self._step()

    def poll_transfers(self) -> list[RequestOutput]:
        """While idle: free KV that decode instances acknowledged (prefill role)."""
        return self._poll_disagg()

    def _step(self) -> list[RequestOutput]:
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
        if self._exporting:
            self._publish_exports(batch, failures)
        for request_id in tokens:
            try:
                output = self._process(request_id, sampled[request_id], now)
            except Exception as error:  # noqa: BLE001 - output handling of one request
                output = self._fail(request_id, f"{type(error).__name__}: {error}")
            if output is not None:
                outputs.append(output)
        return outputs

    def _publish_exports(self, batch: Batch, failures: dict[str, str]) -> None:
        """Prefill role: the blocks each handed-off prompt completed in this step become
        readable by its decode instance while the next chunks compute."""
        assert self.disagg is not None
        for chunk in batch.chunks:
            if chunk.request_id in self._exporting and chunk.request_id not in failures:
                request = self.scheduler.requests.get(chunk.request_id)
                if request is not None:
                    self.disagg.publish(request, chunk.end_pos)

    def _fail(self, request_id: str, why: str) -> RequestOutput | None:
        """End one request with an error; the cause goes to the log, not to the client."""
        log.error("request %s failed in the engine: %s", request_id, why)
        known = request_id in self._outputs
        output = self.abort(request_id, FinishReason.ERROR, REQUEST_FAILED_MESSAGE,
                            REQUEST_FAILED)
        if output is None and known:  # its output handling broke half-way: still answer it
            output = RequestOutput(request_id, [], "", 0, 0, finished=True,
                                   finish_reason=FinishReason.ERROR.value,
                                   error=REQUEST_FAILED_MESSAGE, error_code=REQUEST_FAILED)
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
        requests = self.scheduler.requests
        generations = {chunk.request_id: requests[chunk.request_id].num_preemptions
                       for chunk in batch.chunks}
        self._dispatched[seq] = (batch, generations, schedule_start_s, execute_start_s)
        for chunk in batch.chunks:
            if chunk.sample:
                requests[chunk.request_id].in_flight = True
                self._sampling_seq[chunk.request_id] = seq
        # A chunk that samples nothing needs no result: the next chunk may follow it now.
        advanced = tuple(chunk for chunk in batch.chunks if not chunk.sample)
        if advanced:
            self.scheduler.update(Batch(chunks=advanced), {}, self.clock())

    def _complete(self, seq: int, sampled: dict[str, SampledToken]) -> list[RequestOutput]:
        batch, generations, schedule_start_s, execute_start_s = self._dispatched.pop(seq)
        requests = self.scheduler.requests
        current = []
        for chunk in batch.chunks:
            if not chunk.sample:
                continue
            request_id = chunk.request_id
            request = requests.get(request_id)
            if self._sampling_seq.get(request_id) == seq:
                del self._sampling_seq[request_id]
                if request is not None:
                    request.in_flight = False
            # Preempted (or finished) while in flight: this token belongs to a discarded past.
            if request is not None and request.num_preemptions == generations[request_id]:
                current.append(chunk)
            else:
                sampled.pop(request_id, None)
        now = self.clock()
        # Pipelined batches overlap, so busy time is over-counted here; utilisation is
        # clamped to 1 by the load window, and the prefill rate stays a fair estimate.
        self.load.record_step(execute_start_s, now, batch.num_tokens - batch.num_decodes)
        if self.on_step is not None:  # execute time here includes the wait in the pipeline
            self.on_step(StepStats(batch, schedule_start_s, execute_start_s, now,
                                   self.runner.last_forward_s))
        return self._apply(Batch(chunks=tuple(current)), sampled, {}, now)

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
        reason: FinishReason | None = None
        is_stop_token = (token in self.eos_token_ids and not params.ignore_eos) or (
            token in params.stop_token_ids)
        if not is_stop_token and state.matcher is not None and \
                not state.matcher.consume_token(token):
            raise RuntimeError(f"the grammar rejected sampled token {token}: "
                               f"{state.matcher.get_error()}")
        if not self.output_text:
            text = ""
            if is_stop_token:
                reason = FinishReason.STOP
            elif state.matcher is not None and state.matcher.is_stopped():
                reason = FinishReason.STOP  # the grammar is done
            elif request.num_output_tokens >= params.max_tokens or \
                    request.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
        elif is_stop_token:
            text, reason = state.flush(), FinishReason.STOP
        else:
            text, hit_stop_string = state.add_token(token)
            if hit_stop_string:
                reason = FinishReason.STOP
            elif state.matcher is not None and state.matcher.is_stopped():
                text, reason = text + state.flush(), FinishReason.STOP  # the grammar is done
            elif request.num_output_tokens >= params.max_tokens or \
                    request.num_tokens >= self.max_model_len:
                text, reason = text + state.flush(), FinishReason.LENGTH
        new_tokens = request.output_token_ids[state.emitted_tokens:]
        state.emitted_tokens = request.num_output_tokens
        kv_transfer = None
        if request_id in self._exporting:
            # Prefill role: the first token ends the request here. Unless it already ended
            # the request, its KV goes to a decode instance, which continues from it.
            if reason is None:
                assert self.disagg is not None
                handle = self.disagg.export(request, now)
                kv_transfer = handle.to_json() if handle is not None else None
                # No handle: the decode side gave up on this hand-off mid-prompt (it
                # acknowledged early). Not a natural end either, so a router does not
                # mistake the first token for the whole answer.
                reason = FinishReason.LENGTH if handle is not None else FinishReason.ABORT
            self._end_export(request_id)
        if reason is not None:
            outputs = request.num_output_tokens
            if request.slo.tpot_s is not None and outputs > 1 and state.first_token_s is not None:
                self.load.record_finish(now, (now - state.first_token_s) / (outputs - 1),
                                        request.slo.tpot_s)
            self.scheduler.finish(request_id, reason, now)
            self.runner.release((request_id,))
            del self._outputs[request_id]
            output = self._final_output(request, state, new_tokens, text)
            output.kv_transfer = kv_transfer
            output.stop_token = is_stop_token
            return output
        logprobs, state.logprobs = state.logprobs, []
        return RequestOutput(request_id=request_id, new_token_ids=new_tokens, new_text=text,
                             num_prompt_tokens=request.prompt_len,
                             num_output_tokens=request.num_output_tokens, logprobs=logprobs,
                             num_cached_tokens=request.num_cached_tokens)

    def _final_output(self, request: Request, state: _OutputState, new_tokens: list[int],
                      text: str, error: str | None = None) -> RequestOutput:
        reason = request.finish_reason.value if request.finish_reason else None
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_tokens, new_text=text,
            num_prompt_tokens=request.prompt_len, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, finished=True, finish_reason=reason, logprobs=state.logprobs,
            arrival_s=state.arrival_s, first_token_s=state.first_token_s,
            finished_s=request.finished_s, error=error)

    def warm_up(self, timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
        """Run one real one-token request through every rank and wait for its token, so that
        an instance says it is ready only once it has served. Raises ``EngineDeadError`` if a
        worker is gone, ``RuntimeError`` if the step fails or takes longer than
        ``timeout_s``. Leaves no trace: step observers are not told, and the load window
        starts afresh."""
        on_step, self.on_step = self.on_step, None
        try:
            request_id = self.add_request([0], SamplingParams(max_tokens=1, temperature=0.0,
                                                              ignore_eos=True),
                                          WARM_UP_REQUEST_ID)
            deadline = self.clock() + timeout_s
            final: RequestOutput | None = None
            while final is None:
                if self.clock() > deadline:
                    self.abort(request_id)
                    raise RuntimeError(f"the engine did not complete a one-token request in "
                                       f"{timeout_s:.0f} s")
                final = next((out for out in self.step() if out.finished), None)
                if final is None and (wait_s := self.idle_wait_s()) > 0:
                    time.sleep(wait_s)
            if final.finish_reason == FinishReason.ERROR.value:
                raise RuntimeError(f"the engine failed its warm-up request: {final.error}")
        finally:
            self.on_step = on_step
        self.load = LoadWindow(start_s=self.clock())

    # -- offline use ------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; returns the generated token ids of each, in order."""
        ids = [self.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for output in self.step():
                tokens[output.request_id].extend(output.new_token_ids)
            if self.has_unfinished() and (wait_s := self.idle_wait_s()) > 0:
                time.sleep(wait_s)  # nothing to add here, so no request can cut the wait short
        return [tokens[rid] for rid in ids]


def _make_runner(config: EngineConfig, model_config: ModelConfig) -> Runner:
    """The in-process runner; a parallel config needs its runner passed in."""
    if not config.parallel.is_single_process:
        raise ValueError(
            f"tp x spp x kvp = {config.parallel.world_size} needs worker processes: build the "
            "engine with slipstream.agent.parallel.compose.build_engine")
    return ModelRunner(config, model_config)


def _load_predictor(config: EngineConfig) -> RuntimePredictor | None:
    if config.profile_dir is None:
        return None
    return RuntimePredictor.from_directory(config.profile_dir)
