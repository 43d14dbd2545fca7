"""Command-line flags of the scheduler that more than one command shares.

    slipstream serve / slipstream simulate --add_short_prefill_arguments()--> argparse
        --short_prefill_settings(args)--> SchedulerConfig fields

Here, in the scheduler, so that the simulator's CLI need not import the server's.
"""

from __future__ import annotations

import argparse
from typing import Any

from slipstream.agent.scheduler.config import SHORT_PREFILL_BATCHING_MODES, SchedulerConfig


def add_short_prefill_arguments(parser: argparse.ArgumentParser) -> None:
    """The AWD flags, shared by `slipstream serve` and `slipstream simulate`."""
    defaults = SchedulerConfig()
    awd = parser.add_argument_group(
        "short-prefill batching (PLA-Serve Adaptive Wait-Depth)",
        "With awd, a new prompt of at most --awd-max-prompt-tokens tokens (and below "
        "--long-request-threshold-tokens) waits briefly so that short prompts are prefilled "
        "in groups: a group goes as soon as it reaches AWD's target depth, its window closes, "
        "a member's TTFT deadline is near, or its oldest member waited --awd-max-head-wait-ms. "
        "Meant for a short-prefill pool under heavy short traffic; it adds up to the window "
        "to a lone request's TTFT.")
    awd.add_argument("--short-prefill-batching", choices=SHORT_PREFILL_BATCHING_MODES,
                     default=defaults.short_prefill_batching,
                     help="off admits every request at once; awd batches short prefills")
    awd.add_argument("--awd-max-prompt-tokens", type=int,
                     default=defaults.awd_max_prompt_tokens, metavar="TOKENS",
                     help="longest prompt AWD holds (a power of two >= 8); length buckets are "
                          "8, 16, ... up to it")
    awd.add_argument("--awd-max-wait-ms", type=float, default=defaults.awd_max_wait_ms,
                     metavar="MS", help="longest a group waits to fill (W_max)")
    awd.add_argument("--awd-max-head-wait-ms", type=float,
                     default=defaults.awd_max_head_wait_ms, metavar="MS",
                     help="no prompt is held longer than this")
    awd.add_argument("--awd-slack-threshold-ms", type=float,
                     default=defaults.awd_slack_threshold_ms, metavar="MS",
                     help="release a group once a member's TTFT deadline is this close, after "
                          "one estimated prefill step")


def short_prefill_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The AWD fields of SchedulerConfig from the flags above."""
    return dict(short_prefill_batching=args.short_prefill_batching,
                awd_max_prompt_tokens=args.awd_max_prompt_tokens,
                awd_max_wait_ms=args.awd_max_wait_ms,
                awd_max_head_wait_ms=args.awd_max_head_wait_ms,
                awd_slack_threshold_ms=args.awd_slack_threshold_ms)
