"""The CPU LM head pads two or three rows to four (``F.linear``; oneDNN's reordered head needs
no padding); either way the logits must be those of the rows."""

from __future__ import annotations

import pytest
import torch

from slipstream.agent.engine.config import EngineConfig, ModelConfig
from slipstream.agent.engine.step.model_runner import ModelRunner
from slipstream.agent.engine.models.llama import MIN_CPU_LOGIT_ROWS


@pytest.mark.parametrize("cpu_matmul", ["torch", "auto"])
def test_padded_logits_equal_each_row_alone(tiny_model_dir, cpu_matmul):
    runner = ModelRunner(EngineConfig(model_dir=tiny_model_dir, device="cpu", num_kv_blocks=16,
                                      cpu_matmul=cpu_matmul),
                         ModelConfig.from_dir(tiny_model_dir))
    model = runner.model
    hidden = torch.randn(MIN_CPU_LOGIT_ROWS + 1, runner.model_config.hidden_size)
    with torch.inference_mode():
        one_by_one = torch.cat([model.compute_logits(hidden[i:i + 1]) for i in range(len(hidden))])
        for rows in range(1, len(hidden) + 1):
            logits = model.compute_logits(hidden[:rows])
            assert logits.shape == (rows, runner.model_config.vocab_size)
            torch.testing.assert_close(logits, one_by_one[:rows], rtol=1e-5, atol=1e-5)
