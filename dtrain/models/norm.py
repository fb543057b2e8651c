"""RMSNorm of the blocks, the final norm and the per-head or latent norms of attention."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed with its weight in the input's dtype: under autocast on fp32
    weights (one GPU, no FSDP) the activations are bf16, and a weight of another dtype would
    send ``rms_norm`` to its slower unfused kernel. FSDP's mixed precision computes the same (its
    weights arrive in bf16)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)

