"""The ``slipstream`` command. Each subcommand lives in its own module, imported lazily so
that ``slipstream --help`` is instant and the operator image never imports torch.

A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int``. The parsed
arguments go to ``run`` and no further: ``slipstream serve`` turns them into its config
(``agent/server/cli_flags.py``), which reads a ``--config`` file itself.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("slipstream.agent.server.cli", "Serve a model behind an OpenAI-compatible HTTP API."),
    "make-tiny-model": ("slipstream.agent.engine.models.tiny_model",
                        "Write a small random-weight Llama in Hugging Face format."),
    "convert-gguf": ("slipstream.agent.engine.models.gguf_model",
                     "Write a Hugging Face model directory from a GGUF file (llama.cpp's format)."),
    "router": ("slipstream.agent.router.cli",
               "Route OpenAI requests to short/long prefill pools by prompt length."),
    "worker": ("slipstream.agent.parallel.launch",
               "Start this node's worker ranks of a multi-node instance (env-configured)."),
    "eval-quant": ("slipstream.bench.quant_eval",
                   "Quality of each weight format: KL and greedy agreement against the float "
                   "model."),
    "profile": ("slipstream.agent.engine.profile.profiler",
                "Measure per-layer op times of the engine on this device (for --profile)."),
    "simulate": ("slipstream.sim.cli",
                 "Replay a workload through the real scheduler on a performance model."),
    "bench": ("slipstream.bench.cli",
              "Benchmarks; `bench serve` loads any OpenAI-compatible endpoint."),
    "tenants": ("slipstream.agent.server.tenancy.cli",
                "API keys and tenants files: new-key, hash-key, check (docs/tenancy.md)."),
    "operator": ("slipstream.operator.cli",
                 "Run the ServingReplica Kubernetes operator (kopf) in this process."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Slipstream: LLM serving for mixed short/long traffic.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        # Arguments are added lazily in main(), only for the chosen subcommand.
    return parser


def parse_subcommand(argv: list[str]) -> tuple[ModuleType, argparse.Namespace]:
    """The subcommand's module and its parsed arguments (``argv[0]`` names the subcommand)."""
    module_name, help_text = SUBCOMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    # No abbreviated flags: `slipstream router --decode X` was silently read as
    # --decode-weight-tokens X. A flag is spelt out or refused.
    sub_parser = argparse.ArgumentParser(prog=f"slipstream {argv[0]}", description=help_text,
                                         formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                         allow_abbrev=False)
    module.add_arguments(sub_parser)
    return module, sub_parser.parse_args(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # prints help or the "invalid choice" error
        parser.print_help()
        return 0 if not argv else 2
    module, args = parse_subcommand(argv)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
