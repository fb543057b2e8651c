"""Multi-token prediction (MTP, DeepSeek-V3 report section 2.2), single-device code.

``mtp_depths`` = D extra depths follow the model. Depth k (1..D) predicts, at each position i,
the token k + 1 places past i's next token: it combines the previous depth's representation of
token i (depth 0: the model's, after its final norm) with the embedding of token i + k,

    h'_k = proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h_{k-1})]),  h_k = norm_k(block_k(h'_k)),

and the output head shared with the model gives its logits. The embedding and the output head
are the model's own (no copies); each depth has its norms, projection and one transformer block.
The concatenation puts the embedding first, as DeepSeek-V3's released weights (``eh_proj``) and
Megatron-Core do; the report's equation writes the two halves the other way round.

How the model is fed: the tokens of every depth come in one ``(batch, seq, 1 + D)`` tensor
(``mtp_columns``: column 0 the inputs, column k the inputs k places on) and the targets in
another of the same shape. The model embeds all columns at once, carries the depths' embeddings
along its blocks in a hidden state of shape ``(batch, seq, 1 + D, dim)`` (so a pipeline stage
passes them to the next stage with the main hidden state) and returns the logits of the model
and of each depth one after the other along the batch: ``(batch x (1 + D), seq, vocab)``. The
loss of each depth is the training side's (``dtrain.mtp``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.models.args import LlamaArgs
from dtrain.models.norm import RMSNorm

IGNORE = -100  # a target no loss counts (F.cross_entropy's ignore_index)


class MTPDepth(nn.Module):
    """One prediction depth around ``block`` (a transformer block of the model's kind)."""

    def __init__(self, args: LlamaArgs, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.hnorm = RMSNorm(args.dim, eps=args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The previous depth's ``h`` and the embeddings of the tokens this depth reads, both
        (batch, seq, dim) -> this depth's representation (batch, seq, dim), normalised."""
        x = self.proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope))


def mtp_columns(inputs: torch.Tensor, labels: torch.Tensor,
                depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and targets of the model and its ``depths`` MTP depths from a batch's
    ``inputs`` and ``labels`` (batch, seq), labels[i] being the token after inputs[i]:
    ``(batch, seq, 1 + depths)`` each, column k of the tokens being inputs shifted k places on
    and of the targets labels shifted k places on. Positions whose token or target lies past
    the sequence get token 0 and target ``IGNORE``."""
    if depths == 0:
        return inputs, labels
    whole = torch.cat([inputs, labels[:, -1:].clamp(min=0)], dim=1)  # the sequence and one more
    seq = inputs.shape[1]
    tokens, targets = [inputs], [labels]
    for k in range(1, depths + 1):
        tokens.append(F.pad(whole[:, k:seq + 1], (0, k - 1), value=0))
        targets.append(F.pad(labels[:, k:], (0, k), value=IGNORE))
    return torch.stack(tokens, dim=-1), torch.stack(targets, dim=-1)
