"""Prefill/decode disaggregation at the engine level: a prefill engine and a decode engine
(one process, each with its own KV cache and transfer engine) produce exactly the greedy
tokens of one mixed engine, and both give every KV block back.

The two-process version, through HTTP and the router, is tests/server/test_disagg_serving.py.
"""

from __future__ import annotations

import random
import time

import pytest

from slipstream.contracts.request import KVTransfer
from slipstream.agent.engine.config import EngineConfig
from slipstream.agent.engine.disagg_config import DisaggConfig
from slipstream.agent.engine.engine import LLMEngine
from slipstream.agent.engine.errors import KV_TRANSFER_FAILED
from slipstream.contracts.sampling import SamplingParams
from slipstream.agent.scheduler.config import SchedulerConfig

from tests.engine.test_kv_transfer import TRANSPORTS


EXPORT = KVTransfer(remote_decode=True)  # to a prefill instance: hand the KV off

pytestmark = pytest.mark.timeout(300)


def _engine(model_dir, role="mixed", transport="zmq", max_batched_tokens=64,
            **disagg) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", num_kv_blocks=96,
                                  scheduler=SchedulerConfig(
                                      max_batched_tokens=max_batched_tokens),
                                  disagg=DisaggConfig(role=role, transport=transport,
                                                      **disagg)))


def _run(engine: LLMEngine, ids: set[str], outputs: dict, deadline_s: float = 120) -> None:
    end = time.monotonic() + deadline_s
    while ids - {rid for rid, outs in outputs.items() if outs and outs[-1].finished}:
        assert time.monotonic() < end, "engine did not finish its requests"
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        if not engine.has_unfinished():
            time.sleep(0.001)


def _wait_for(condition, what: str, engine: LLMEngine | None = None, timeout_s: float = 30):
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        if engine is not None:
            engine.poll_transfers()
        time.sleep(0.005)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Lengths on and around block boundaries (16), and a few longer than one chunk (64).
    lengths = [1, 15, 16, 17, 31, 33, 64, 100, 150] + [rng.randint(2, 120) for _ in range(count)]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths[:count]]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefill_then_decode_equals_mixed_for_many_prompts(tiny_model_dir, transport):
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    mixed = _engine(tiny_model_dir)
    try:
        expected = mixed.generate(prompts, params)
    finally:
        mixed.close()
    prefill = _engine(tiny_model_dir, "prefill", transport, blocks_per_read=2)
    decode = _engine(tiny_model_dir, "decode", transport, blocks_per_read=2)
    try:
        # All prompts at once on both sides: prefills batch together, decodes batch together
        # while later transfers are still arriving.
        prefill_out: dict = {}
        ids = {prefill.add_request(p, params, f"p{i}", kv_transfer=EXPORT)
               for i, p in enumerate(prompts)}
        _run(prefill, ids, prefill_out)
        decode_out: dict = {}
        for i, prompt in enumerate(prompts):
            final = prefill_out[f"p{i}"][-1]
            assert final.finish_reason == "length" and final.kv_transfer is not None
            assert final.new_token_ids == [expected[i][0]]
            decode.add_request(prompt, params, f"d{i}",
                               kv_transfer=KVTransfer(handle=final.kv_transfer))
        _run(decode, {f"d{i}" for i in range(len(prompts))}, decode_out)
        for i in range(len(prompts)):
            tokens = [t for out in decode_out[f"d{i}"] for t in out.new_token_ids]
            assert tokens == expected[i], f"prompt {i} (length {len(prompts[i])})"
            assert decode_out[f"d{i}"][-1].finish_reason == "length"
        # Every block back on both sides: the decode side at once, the prefill side once the
        # acknowledgements have been applied by its engine thread.
        assert decode.block_manager.kv_blocks_used == 0
        _wait_for(lambda: prefill.block_manager.kv_blocks_used == 0,
                  "the prefill instance to free acknowledged KV", prefill)
        assert prefill.role.disagg is not None and prefill.role.disagg.exports is not None
        assert len(prefill.role.disagg.exports) == 0
    finally:
        prefill.close()
        decode.close()


def test_decode_reports_a_dead_prefill_instance_cleanly(tiny_model_dir):
    """The handle points at a prefill instance that is gone: the request fails with the
    kv_transfer_failed code (a 503 the router may retry) and its blocks come back."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 45))
    prefill = _engine(tiny_model_dir, "prefill")
    decode = LLMEngine(EngineConfig(
        model_dir=tiny_model_dir, device="cpu", num_kv_blocks=96,
        disagg=DisaggConfig(role="decode", transport="zmq", transfer_timeout_s=0.5)))
    try:
        out: dict = {}
        prefill.add_request(prompt, params, "p", kv_transfer=EXPORT)
        _run(prefill, {"p"}, out)
        handle = out["p"][-1].kv_transfer
        prefill.close()  # the side channel goes with it
        decode_out: dict = {}
        decode.add_request(prompt, params, "d", kv_transfer=KVTransfer(handle=handle))
        _run(decode, {"d"}, decode_out)
        final = decode_out["d"][-1]
        assert final.finish_reason == "error" and final.error_code == KV_TRANSFER_FAILED
        assert final.new_token_ids == []
        assert decode.block_manager.kv_blocks_used == 0 and not decode.has_unfinished()
    finally:
        prefill.close()
        decode.close()


def test_wrong_role_and_wrong_prompt_are_refused(tiny_model_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prefill = _engine(tiny_model_dir, "prefill")
    decode = _engine(tiny_model_dir, "decode")
    mixed = _engine(tiny_model_dir)
    try:
        with pytest.raises(ValueError, match="--role prefill"):
            mixed.add_request([5, 6, 7], params, kv_transfer=EXPORT)
        out: dict = {}
        prefill.add_request([5, 6, 7], params, "p", kv_transfer=EXPORT)
        _run(prefill, {"p"}, out)
        handle = {**out["p"][-1].kv_transfer, "do_remote_prefill": True}
        with pytest.raises(ValueError, match="--role decode"):
            mixed.add_request([5, 6, 7], params, kv_transfer=KVTransfer.from_params(handle))
        with pytest.raises(ValueError, match="another prompt"):
            decode.add_request([5, 6, 8], params, kv_transfer=KVTransfer.from_params(handle))
        assert decode.block_manager.kv_blocks_used == 0 and not decode.has_unfinished()
    finally:
        for engine in (prefill, decode, mixed):
            engine.close()


def test_an_unacknowledged_hold_is_freed_after_its_timeout(tiny_model_dir):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill = LLMEngine(EngineConfig(
        model_dir=tiny_model_dir, device="cpu", num_kv_blocks=96,
        disagg=DisaggConfig(role="prefill", transport="zmq", hold_timeout_s=0.2)))
    try:
        out: dict = {}
        prefill.add_request(list(range(3, 60)), params, "p", kv_transfer=EXPORT)
        _run(prefill, {"p"}, out)
        assert prefill.block_manager.kv_blocks_used == 4  # 57 prompt tokens, 16 per block
        _wait_for(lambda: prefill.block_manager.kv_blocks_used == 0, "the hold to expire",
                  prefill)
        assert prefill.role.disagg is not None and prefill.role.disagg.exports is not None
        assert prefill.role.disagg.exports.num_expired_total == 1
    finally:
        prefill.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_decode_instance_holding_a_prefix_receives_only_the_rest(tiny_model_dir, transport):
    """With prefix caching, a prompt whose first blocks the decode instance already holds
    (from an earlier request it decoded) shares them and transfers only the blocks after
    them; the output still equals a mixed engine's, and every block comes back."""
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(48)]  # three full 16-token blocks
    prompts = {"first": shared + [rng.randrange(3, 250) for _ in range(10)],  # 58 tokens
               "other": shared + [rng.randrange(3, 250) for _ in range(20)]}  # 68 tokens
    prompts["again"] = list(prompts["first"])
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = _engine(tiny_model_dir)
    try:
        expected = dict(zip(prompts, mixed.generate(list(prompts.values()), params)))
    finally:
        mixed.close()
    prefill = _engine(tiny_model_dir, "prefill", transport)
    decode = _engine(tiny_model_dir, "decode", transport, blocks_per_read=1)
    try:
        received = {}
        for name, prompt in prompts.items():  # one after the other: each finds the last's KV
            before = decode.stats()
            out: dict = {}
            prefill.add_request(prompt, params, f"p-{name}", kv_transfer=EXPORT)
            _run(prefill, {f"p-{name}"}, out)
            handle = {**out[f"p-{name}"][-1].kv_transfer, "do_remote_prefill": True}
            decode_out: dict = {}
            decode.add_request(prompt, params, name, kv_transfer=KVTransfer.from_params(handle))
            _run(decode, {name}, decode_out)
            assert [t for o in decode_out[name] for t in o.new_token_ids] == expected[name], name
            after = decode.stats()
            received[name] = (after.kv_transfer_blocks - before.kv_transfer_blocks,
                              after.kv_transfer_cached_blocks - before.kv_transfer_cached_blocks)
        # 58 tokens are 4 blocks: none cached at first. The other prompt (5 blocks) shares the
        # three full blocks of the common prefix; the repeated prompt shares them too (its
        # last block, holding the final prompt token, is always transferred).
        assert received == {"first": (4, 0), "other": (2, 3), "again": (1, 3)}
        stats = decode.stats()
        assert stats.kv_transfers_completed == 3 and stats.kv_transfers_failed == 0
        assert stats.kv_transfer_bytes == 7 * decode.role.disagg.layout.bytes_per_block
        assert decode.block_manager.kv_blocks_used == 0
        _wait_for(lambda: prefill.block_manager.kv_blocks_used == 0,
                  "the prefill instance to free acknowledged KV", prefill)
        assert prefill.stats().kv_transfers_acknowledged == 3
    finally:
        prefill.close()
        decode.close()


def test_without_prefix_caching_every_block_is_transferred(tiny_model_dir):
    prompt = list(range(5, 55))  # 50 tokens: 4 blocks
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prefill = _engine(tiny_model_dir, "prefill")
    decode = LLMEngine(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=96,
                                    disagg=DisaggConfig(role="decode", transport="zmq")),
                       SchedulerConfig(prefix_caching=False))
    try:
        for name in ("a", "b"):
            out: dict = {}
            prefill.add_request(prompt, params, f"p{name}", kv_transfer=EXPORT)
            _run(prefill, {f"p{name}"}, out)
            decode.add_request(prompt, params, name,
                               kv_transfer=KVTransfer(handle=out[f"p{name}"][-1].kv_transfer))
            _run(decode, {name}, {})
        stats = decode.stats()
        assert (stats.kv_transfer_blocks, stats.kv_transfer_cached_blocks) == (8, 0)
    finally:
        prefill.close()
        decode.close()


# ---- streaming hand-off: the decode side reads each prefill chunk's blocks as they land ----

def _run_both(prefill: LLMEngine, decode: LLMEngine, ids: set[str], outputs: dict,
              deadline_s: float = 180) -> None:
    """Step both engines in turn until the decode side has finished ``ids``."""
    end = time.monotonic() + deadline_s
    while ids - {rid for rid, outs in outputs.items() if outs and outs[-1].finished}:
        assert time.monotonic() < end, "the engines did not finish their requests"
        prefill.step()
        for output in decode.step():
            outputs.setdefault(output.request_id, []).append(output)
        if not prefill.has_unfinished() and not decode.scheduler.has_unfinished():
            time.sleep(0.001)  # only transfers in flight: let their thread run


def _start_handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
                   params: SamplingParams, name: str) -> None:
    prefill.add_request(prompt, params, f"p-{name}", kv_transfer=EXPORT)
    announced = prefill.handle_output(f"p-{name}")
    assert announced is not None and announced.kv_transfer is not None
    handle = announced.kv_transfer
    assert handle["streaming"] and handle["block_ids"] == []
    decode.add_request(prompt, params, name, kv_transfer=KVTransfer(handle=handle))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_streaming_handoff_equals_mixed_for_many_prompts(tiny_model_dir, transport):
    """Decode requests are added with the streaming handle the moment their prefill is
    queued; prompts up to 150 tokens take up to five 32-token prefill chunks."""
    prompts = _prompts(12, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mixed = _engine(tiny_model_dir)
    try:
        expected = mixed.generate(prompts, params)
    finally:
        mixed.close()
    prefill = _engine(tiny_model_dir, "prefill", transport, max_batched_tokens=32)
    decode = _engine(tiny_model_dir, "decode", transport, blocks_per_read=1)
    try:
        for i, prompt in enumerate(prompts):
            _start_handoff(prefill, decode, prompt, params, f"d{i}")
        outputs: dict = {}
        _run_both(prefill, decode, {f"d{i}" for i in range(len(prompts))}, outputs)
        for i in range(len(prompts)):
            tokens = [t for out in outputs[f"d{i}"] for t in out.new_token_ids]
            assert tokens == expected[i], f"prompt {i} (length {len(prompts[i])})"
        stats = decode.stats()
        assert stats.kv_transfers_completed == len(prompts) and stats.kv_transfers_failed == 0
        assert decode.block_manager.kv_blocks_used == 0
        _wait_for(lambda: prefill.block_manager.kv_blocks_used == 0,
                  "the prefill instance to free acknowledged KV", prefill)
        assert prefill.stats().kv_transfers_acknowledged == len(prompts)
        assert len(prefill.role.disagg.exports) == 0 and prefill.handle_output("p-d0") is None
    finally:
        prefill.close()
        decode.close()


def _step_until_chunk(prefill: LLMEngine, request_id: str, tokens: int) -> None:
    """Step the prefill engine until ``request_id`` has computed at least ``tokens``."""
    request = prefill.scheduler.requests[request_id]
    while request.num_computed_tokens < tokens:
        assert not any(o.finished for o in prefill.step())


def _past_first_chunk(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
                      params: SamplingParams) -> None:
    """Hand request "d" off and run its prefill ("p-d") one 32-token chunk in, until the
    decode side holds that chunk's two blocks."""
    _start_handoff(prefill, decode, prompt, params, "d")
    _step_until_chunk(prefill, "p-d", 32)
    assert decode.role.disagg is not None
    _wait_for(lambda: (decode.step(), decode.role.disagg.blocks_received("d"))[1] == 2,
              "the decode instance to receive the first chunk's two blocks")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_blocks_arrive_while_later_prefill_chunks_are_still_to_compute(tiny_model_dir, transport):
    """The overlap itself: after the first 32-token chunk of a 150-token prompt, the decode
    instance receives its two full blocks while the prefill instance has not run the other
    four chunks; the last block and the first token follow at the end."""
    prompt = [random.Random(11).randrange(3, 250) for _ in range(150)]  # 10 blocks
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = _engine(tiny_model_dir)
    try:
        expected = mixed.generate([prompt], params)[0]
    finally:
        mixed.close()
    prefill = _engine(tiny_model_dir, "prefill", transport, max_batched_tokens=32)
    decode = _engine(tiny_model_dir, "decode", transport, blocks_per_read=1)
    try:
        _past_first_chunk(prefill, decode, prompt, params)
        request = prefill.scheduler.requests["p-d"]
        assert request.num_computed_tokens < len(prompt)  # later chunks not computed yet
        _step_until_chunk(prefill, "p-d", 96)
        _wait_for(lambda: (decode.step(), decode.role.disagg.blocks_received("d"))[1] == 6,
                  "the decode instance to receive the blocks of the next two chunks")
        outputs: dict = {}
        _run_both(prefill, decode, {"d"}, outputs)
        assert [t for out in outputs["d"] for t in out.new_token_ids] == expected
        stats = decode.stats()
        # 9 full blocks: at least the 6 waited for above arrived during the prefill; the
        # last, partial block can only come once the prompt is complete.
        assert 6 <= stats.kv_transfer_overlapped_blocks <= 9
        assert stats.kv_transfer_blocks == 10 and stats.kv_transfers_completed == 1
        assert decode.block_manager.kv_blocks_used == 0
        _wait_for(lambda: prefill.block_manager.kv_blocks_used == 0,
                  "the prefill instance to free acknowledged KV", prefill)
    finally:
        prefill.close()
        decode.close()


def test_prefill_aborted_mid_prompt_fails_the_decode_side_cleanly(tiny_model_dir):
    prompt = list(range(3, 103))  # 100 tokens: four 32-token chunks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill = _engine(tiny_model_dir, "prefill", max_batched_tokens=32)
    decode = _engine(tiny_model_dir, "decode")
    try:
        _past_first_chunk(prefill, decode, prompt, params)
        prefill.abort("p-d")  # a client gone, or the router gave up on this prefill
        assert prefill.block_manager.kv_blocks_used == 0 and len(prefill.role.disagg.exports) == 0
        outputs: dict = {}
        _run(decode, {"d"}, outputs)
        final = outputs["d"][-1]
        assert final.finish_reason == "error" and final.error_code == KV_TRANSFER_FAILED
        assert decode.block_manager.kv_blocks_used == 0 and not decode.has_unfinished()
        assert decode.stats().kv_transfers_failed == 1
    finally:
        prefill.close()
        decode.close()


def test_prefill_instance_dying_mid_prompt_fails_the_decode_side_cleanly(tiny_model_dir):
    prompt = list(range(3, 103))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill = _engine(tiny_model_dir, "prefill", max_batched_tokens=32)
    decode = _engine(tiny_model_dir, "decode", transfer_timeout_s=0.5)
    try:
        _past_first_chunk(prefill, decode, prompt, params)
        prefill.close()  # its side channel goes with it, mid-prompt
        outputs: dict = {}
        _run(decode, {"d"}, outputs)
        final = outputs["d"][-1]
        assert final.finish_reason == "error" and final.error_code == KV_TRANSFER_FAILED
        assert decode.block_manager.kv_blocks_used == 0 and not decode.has_unfinished()
    finally:
        prefill.close()
        decode.close()


def test_decode_side_giving_up_mid_prompt_frees_the_prefill_hold(tiny_model_dir):
    """The decode request is aborted while its prompt is still prefilling: it acknowledges,
    the prefill side stops offering blocks, its request ends without a hand-off, and both
    sides are back at zero blocks."""
    prompt = list(range(3, 103))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefill = _engine(tiny_model_dir, "prefill", max_batched_tokens=32)
    decode = _engine(tiny_model_dir, "decode")
    try:
        _past_first_chunk(prefill, decode, prompt, params)
        assert decode.abort("d") is not None
        _wait_for(lambda: (decode.step(), decode.role.disagg.num_pending)[1] == 0,
                  "the decode side to end its transfer")
        assert decode.block_manager.kv_blocks_used == 0
        _wait_for(lambda: len(prefill.role.disagg.exports) == 0, "the acknowledgement", prefill)
        out: dict = {}
        _run(prefill, {"p-d"}, out)
        final = out["p-d"][-1]
        assert final.kv_transfer is None  # nobody to hand it to any more
        assert final.finish_reason == "abort"  # and not an answer ending at its first token
        assert prefill.block_manager.kv_blocks_used == 0
        assert prefill.stats().kv_transfers_acknowledged == 1
    finally:
        prefill.close()
        decode.close()
