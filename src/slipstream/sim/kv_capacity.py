"""How many KV tokens an instance holds, from its GPUs' memory and the model's shape.

    ProfileMeta.model + InstanceConfig degrees + GPU memory --> KV blocks per instance

Each GPU keeps a share of the weights (``1 / (tp * spp)``) and, for its stage's layers and
its tensor-parallel share of the KV heads, the KV of the tokens its KVP group stores. What is
left of ``memory_utilization * gpu_memory`` holds KV. Used when the simulator is not told the
number of blocks; a CPU profile has no GPU memory, so give ``--num-kv-blocks`` there.
"""

from __future__ import annotations

from slipstream.agent.scheduler.block_manager import BLOCK_SIZE
from slipstream.agent.scheduler.profile_table import ProfileMeta

BYTES_PER_VALUE = 2  # bf16 weights and KV
LLAMA3_VOCAB_SIZE = 128_256


def estimate_kv_blocks(meta: ProfileMeta, tp: int, spp: int, kvp: int,
                       gpu_memory_gib: float = 80.0, memory_utilization: float = 0.9) -> int:
    model = meta.model
    needed = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    if any(key not in model for key in needed):
        raise ValueError("the profile does not describe the model's shape; give the number "
                         "of KV blocks explicitly")
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    kv_heads, intermediate = model["num_key_value_heads"], model["intermediate_size"]
    head_dim = hidden // heads
    vocab = model.get("vocab_size", LLAMA3_VOCAB_SIZE)
    layers = meta.num_layers
    per_layer = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden \
        + 3 * hidden * intermediate
    weight_bytes = (layers * per_layer + 2 * vocab * hidden + _extra_expert_weights(model)) \
        * BYTES_PER_VALUE / (tp * spp)
    kv_heads_per_gpu = max(1, kv_heads // tp)
    kv_bytes_per_token = 2 * (layers // spp) * kv_heads_per_gpu * head_dim * BYTES_PER_VALUE
    free_bytes = gpu_memory_gib * 2**30 * memory_utilization - weight_bytes
    if free_bytes <= 0:
        raise ValueError("the weights do not fit in GPU memory")
    tokens_per_group = free_bytes / kv_bytes_per_token
    return int(tokens_per_group * kvp) // BLOCK_SIZE


def _extra_expert_weights(model: dict) -> int:
    """A mixture of experts' weights beyond one dense MLP per layer: every expert is stored
    (only top-k are read per token; the profile's moe_block times that), so memory counts all
    of them, plus the router and the shared expert."""
    if "num_experts" not in model:
        return 0
    hidden, sparse = model["hidden_size"], model.get("num_sparse_layers", 0)
    experts = model["num_experts"] * 3 * hidden * model["moe_intermediate_size"]
    shared = 3 * hidden * model.get("shared_expert_intermediate_size", 0)
    dense = 3 * hidden * model["intermediate_size"]
    return sparse * (experts + shared + hidden * model["num_experts"] - dense)


# KV tier bandwidths for GPU profiles, which measure none: host -> GPU over one PCIe 5 x16
# link as KV offloading achieves it in practice, and reads from two PCIe 4 NVMe drives.
PCIE_GB_PER_S = 25.0
NVME_GB_PER_S = 12.0


def kv_bytes_per_block(meta: ProfileMeta) -> int:
    """Bytes of one 16-token KV block of the whole model (K and V, every layer, bf16)."""
    model = meta.model
    if "num_key_value_heads" not in model or "hidden_size" not in model:
        raise ValueError("the profile does not describe the model's shape; KV tiers need it")
    head_dim = model["hidden_size"] // model["num_attention_heads"]
    return 2 * meta.num_layers * model["num_key_value_heads"] * head_dim * BYTES_PER_VALUE \
        * BLOCK_SIZE
