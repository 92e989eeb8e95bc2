"""bench-moe's MoE layer (E 64, d 512, FFN 2048, top-2, bf16, grouped GEMMs) with ``--moe-compiled-routing on``
and ``--moe-compiled-experts on``, trained at 8192 tokens and then 6144: the second count compiles the
dynamic-shape entries that training with varying batch sizes runs."""

import torch

from torchscale_fairseq.modules.feedforward import FFNSpec
from torchscale_fairseq.modules.moe.config import MoEConfig
from torchscale_fairseq.modules.moe.layer import MoELayer

torch.manual_seed(0)
cfg = MoEConfig(expert_count=64, top_k=2, expert_ffn_dim=2048, capacity_factor=1.0, second_expert_policy="all")
layer = MoELayer(cfg, FFNSpec(512, 2048)).to(dtype=torch.bfloat16)
layer.experts.grouped_mm = True
layer.compiled_routing = layer.compiled_experts = True
for tokens in (8192, 6144):
    x = torch.randn(tokens // 512, 512, 512, dtype=torch.bfloat16, requires_grad=True)
    layer(x, None)[0].float().sum().backward()
