"""The API process of a two-process server imports the HTTP side, the engine-core client and
the admission checks, and none of torch or the model code: that is what keeps it quick to
start next to the engine core (which imports torch itself)."""

from __future__ import annotations

import subprocess
import sys

API_MODULES = ("slipstream.cli", "slipstream.agent.server.cli", "slipstream.agent.server.api",
               "slipstream.agent.server.drain", "slipstream.agent.server.engine_core",
               "slipstream.contracts.control", "slipstream.agent.server.api_processes",
               "slipstream.agent.engine.async_engine", "slipstream.agent.engine.engine_client",
               "slipstream.agent.engine.engine_loop", "slipstream.agent.engine.sampling.grammar")
HEAVY = ("torch", "transformers", "slipstream.agent.engine.step.model_runner",
         "slipstream.agent.engine.engine", "slipstream.agent.parallel.compose")


def test_api_side_modules_do_not_import_torch_or_the_model():
    code = (f"import importlib, sys\n"
            f"for name in {API_MODULES!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, check=True)
    assert result.stdout.strip() == "[]", result.stdout
