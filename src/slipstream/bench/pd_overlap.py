"""Streaming KV hand-off against pulling the KV once the prompt is complete, live on the CPU.

One prefill engine and one decode engine in this process, each with its own KV cache, joined
by the real transfer path (Mooncake Transfer Engine over TCP by default, or ZeroMQ). A prompt
long enough for several prefill chunks is handed off two ways, alternately, on fresh random
prompts:

- ``overlap``: the decode request is added with the streaming handle as soon as the prefill
  request is queued; the decode instance reads each chunk's blocks while the next chunk
  computes, so only the last chunk's blocks remain when the prompt is done.
- ``pull-at-end``: the decode request is added with the complete handle the prefill answers
  with (what a router does without streaming); every block moves after the prefill.

The figure of merit is the time from the prefill instance sampling the first token to the
decode instance emitting it (the hand-off gap), split into the wait for the KV and the decode
step that admits the request (its forward included), and the time from arrival to that
token.
The model is a random-weight Llama shaped so that KV blocks are big enough to time (8
layers, 8 KV heads of 64: 256 KiB per 16-token block in fp32); it is written to a temporary
directory and deleted afterwards.

    python -m slipstream.bench.pd_overlap --out results/pd-overlap
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.contracts.request import KVTransfer
from slipstream.agent.engine.models.tiny_model import TinyModelPreset, write_tiny_model

BENCH_PRESET = TinyModelPreset(hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                               vocab_size=4096, max_position_embeddings=131_072)
MODES = ("overlap", "pull-at-end")


def _engines(model_dir: Path, args: argparse.Namespace):
    from slipstream.agent.engine.config import EngineConfig
    from slipstream.agent.engine.disagg_config import DisaggConfig
    from slipstream.agent.engine.engine import LLMEngine
    from slipstream.agent.scheduler.config import SchedulerConfig

    blocks = (args.prompt_tokens // 16 + 8) * 2
    # No prefix cache: every repeat moves every block. Chunks of --chunk-tokens.
    no_cache = SchedulerConfig(prefix_caching=False, max_batched_tokens=args.chunk_tokens)
    prefill = LLMEngine(EngineConfig(
        model_dir=model_dir, device="cpu", num_kv_blocks=blocks,
        disagg=DisaggConfig(role="prefill", transport=args.transport)), no_cache)
    decode = LLMEngine(EngineConfig(
        model_dir=model_dir, device="cpu", num_kv_blocks=blocks,
        disagg=DisaggConfig(role="decode", transport=args.transport,
                            blocks_per_read=args.blocks_per_read)), no_cache)
    return prefill, decode


def hand_off(prefill, decode, prompt: list[int], mode: str, name: str) -> dict:
    """One request through both engines (stepped in turn on this thread; the decode side's
    transfer thread runs alongside). Returns its timings in seconds."""
    from slipstream.contracts.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    clock = time.perf_counter
    arrived = clock()
    prefill.add_request(prompt, params, f"p-{name}", kv_transfer=KVTransfer(remote_decode=True))
    if mode == "overlap":
        announced = prefill.handle_output(f"p-{name}")  # the streaming handle
        assert announced is not None
        decode.add_request(prompt, params, name,
                           kv_transfer=KVTransfer(handle=announced.kv_transfer))
    prefill_done = first_token = None
    first_step_s = 0.0
    deadline = clock() + 300
    while first_token is None:
        if clock() > deadline:
            raise RuntimeError(f"{mode}: no first token from the decode engine in 300 s")
        if prefill_done is None:
            for output in prefill.step():
                if output.finished:
                    prefill_done = clock()
                    if output.kv_transfer is None:
                        raise RuntimeError(f"{mode}: the prefill ended without a hand-off")
                    if mode == "pull-at-end":
                        decode.add_request(prompt, params, name,
                                           kv_transfer=KVTransfer(handle=output.kv_transfer))
        step_started = clock()
        for output in decode.step():
            if output.error:
                raise RuntimeError(f"{mode}: {output.error}")
            if output.new_token_ids and first_token is None:
                first_token = clock()
                first_step_s = first_token - step_started
        if prefill_done is not None and first_token is None:
            time.sleep(0.0005)  # only the transfer thread has work: let it have the core
    # Let the request finish on the decode side, and the prefill side free its hold.
    while decode.has_unfinished():
        decode.step()
    assert prefill_done is not None
    return {"handoff_gap_s": first_token - prefill_done, "prefill_s": prefill_done - arrived,
            "ttft_s": first_token - arrived,
            # The decode step that admitted the request and emitted the token (its forward
            # included): the part of the gap that is not waiting for KV.
            "admit_step_s": first_step_s,
            # What remains of the gap: waiting for the KV to arrive.
            "kv_wait_s": max(0.0, first_token - prefill_done - first_step_s)}


def run(args: argparse.Namespace) -> dict:
    from slipstream.agent.engine.roles.disagg import DisaggRole

    model_dir = Path(tempfile.mkdtemp(prefix="slipstream-pd-overlap-"))
    try:
        write_tiny_model(model_dir, preset=BENCH_PRESET, seed=0, force=True)
        prefill, decode = _engines(model_dir, args)
        try:
            rng = random.Random(0)

            def prompt_of() -> list[int]:
                return [rng.randrange(300, 4000) for _ in range(args.prompt_tokens)]

            hand_off(prefill, decode, prompt_of(), "overlap", "warm-1")  # warm both paths
            hand_off(prefill, decode, prompt_of(), "pull-at-end", "warm-2")
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            overlapped_before = decode.stats().kv_transfer_overlapped_blocks
            overlapped: dict[str, int] = {}
            for repeat in range(args.repeats):
                # Alternate the order so that load drift on the machine hits both alike.
                for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
                    before = decode.stats().kv_transfer_overlapped_blocks
                    timing = hand_off(prefill, decode, prompt_of(), mode, f"{mode}-{repeat}")
                    overlapped[mode] = overlapped.get(mode, 0) + \
                        decode.stats().kv_transfer_overlapped_blocks - before
                    runs[mode].append(timing)
                    print(f"{mode:12s} repeat {repeat}: hand-off gap "
                          f"{timing['handoff_gap_s'] * 1000:7.1f} ms, TTFT "
                          f"{timing['ttft_s'] * 1000:7.1f} ms (admitting step "
                          f"{timing['admit_step_s'] * 1000:.1f} ms)", flush=True)
            assert isinstance(decode.role, DisaggRole)
            block_bytes = decode.role.disagg.layout.bytes_per_block
            stats = decode.stats()
            keys = ("handoff_gap_s", "kv_wait_s", "admit_step_s", "prefill_s", "ttft_s")
            summary: dict[str, dict[str, Any]] = {mode: {
                key: {"median": statistics.median(r[key] for r in runs[mode]),
                      "min": min(r[key] for r in runs[mode]),
                      "max": max(r[key] for r in runs[mode])}
                for key in keys} for mode in MODES}
            for mode in MODES:
                summary[mode]["blocks_read_during_prefill"] = overlapped.get(mode, 0)
            return {
                "transport": args.transport, "prompt_tokens": args.prompt_tokens,
                "chunk_tokens": args.chunk_tokens, "blocks_per_read": args.blocks_per_read,
                "repeats": args.repeats, "block_bytes": block_bytes,
                "prompt_blocks": -(-args.prompt_tokens // 16),
                "summary": summary, "runs": runs,
                "overlapped_blocks_total": stats.kv_transfer_overlapped_blocks
                - overlapped_before,
                "gap_ratio_pull_over_overlap":
                    summary["pull-at-end"]["handoff_gap_s"]["median"]
                    / max(summary["overlap"]["handoff_gap_s"]["median"], 1e-9),
                "kv_wait_ratio_pull_over_overlap":
                    summary["pull-at-end"]["kv_wait_s"]["median"]
                    / max(summary["overlap"]["kv_wait_s"]["median"], 1e-9),
            }
        finally:
            prefill.close()
            decode.close()
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for axis, key, title in ((axes[0], "handoff_gap_s", "prefill done -> decode's first token"),
                             (axes[1], "kv_wait_s", "of which waiting for the KV"),
                             (axes[2], "ttft_s", "arrival -> decode's first token (TTFT)")):
        medians = [result["summary"][m][key]["median"] * 1000 for m in MODES]
        lows = [medians[i] - result["summary"][m][key]["min"] * 1000 for i, m in enumerate(MODES)]
        highs = [result["summary"][m][key]["max"] * 1000 - medians[i]
                 for i, m in enumerate(MODES)]
        axis.bar(MODES, medians, yerr=[lows, highs], capsize=6, color=["tab:green", "tab:gray"])
        axis.set_title(title, fontsize=10)
        axis.set_ylabel("ms (median, min-max)")
    figure.suptitle(f"Streaming KV hand-off vs pull at end: {result['prompt_tokens']}-token "
                    f"prompt, {result['chunk_tokens']}-token chunks, {result['transport']}, CPU",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Live CPU benchmark of the streaming KV hand-off (decode reads each prefill "
                    "chunk's blocks while later chunks compute) against pulling the KV once "
                    "the prompt is complete. Writes pd_overlap.json and pd_overlap.png.")
    parser.add_argument("--out", type=Path, default=Path("results/pd-overlap"),
                        help="output directory (default: %(default)s)")
    parser.add_argument("--transport", choices=("mooncake", "zmq"), default="mooncake",
                        help="KV transport (default: %(default)s, the Mooncake Transfer "
                             "Engine over TCP)")
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="prompt length (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=int, default=256,
                        help="prefill chunk size, the engines' max batched tokens "
                             "(default: %(default)s)")
    parser.add_argument("--blocks-per-read", type=int, default=8,
                        help="blocks per transfer read on the decode side (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="hand-offs per mode, alternating (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.prompt_tokens <= args.chunk_tokens:
        parser.error("--prompt-tokens must exceed --chunk-tokens, or there is nothing to "
                     "overlap")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    (args.out / "pd_overlap.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "pd_overlap.png")
    for key, label in (("handoff_gap_s", "hand-off gap"), ("kv_wait_s", "KV wait")):
        value = {m: result["summary"][m][key]["median"] * 1000 for m in MODES}
        print(f"{label} (median): overlap {value['overlap']:.1f} ms, pull-at-end "
              f"{value['pull-at-end']:.1f} ms")
    print(f"wrote {args.out}/pd_overlap.json and pd_overlap.png")


if __name__ == "__main__":
    main()
