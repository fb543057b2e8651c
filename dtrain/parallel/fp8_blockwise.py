"""Blockwise FP8 training (``fp8.recipe = "blockwise"``): DeepSeek-V3's recipe, Megatron-LM's
``--fp8-recipe blockwise`` and Transformer Engine's ``Float8BlockScaling``.

Every operand of the three matmuls of a linear layer is cast to float8 e4m3 in small groups,
each with its own fp32 scale, so one outlier coarsens the rounding of its own group only (under
tensorwise scaling it coarsens the whole tensor's). The groups follow each matmul's reduction
dimension, as the FP8 GEMMs that apply the scales inside their sums need:

- forward, ``y = x W^T``: ``x`` in 1x128 tiles along the input features, ``W`` in 128x128 blocks;
- input gradient, ``dx = dy W``: ``dy`` in 1x128 tiles along the output features, ``W`` in
  the same 128x128 blocks (the same values as the forward's: a block is its own transpose's);
- weight gradient, ``dW = dy^T x``: ``dy`` and ``x`` both in 128x1 tiles along the tokens.

Each group's scale is its absolute maximum over 448 (e4m3's largest value), computed as torchao's
kernels do: the factor ``448 / amax`` in fp64, rounded to fp32, multiplies the values (saturated
to +-448, then cast) and its fp32 reciprocal dequantises. Scales are not rounded to powers of
two (Transformer Engine's default rounds them; torchao and DeepSeek-V3's report do not).

On a Hopper GPU the linears become torchao's ``Float8BlockwiseLinear`` (its Triton casts and the
blockwise-scaled GEMMs; its output is bf16). On the CPU, or with ``fp8.emulate``, they become
``BlockwiseLinear``, which casts the same groups the same way, dequantises and computes the
three matmuls in fp32: the recipe's numerics, at high-precision speed.

A linear converts when ``fp8_filter`` lets it and both its widths are multiples of 128 (whole
blocks) and it has no bias (torchao's layer has none); the rest stay in bf16 and the start-up
line names them. Refused, one line each: tensor parallel (``check_blockwise``), FP8 all-gather
under FSDP (the weights are gathered in high precision, then cast in blocks) and FP8 MoE experts
(no blockwise grouped GEMMs yet: ``fp8.experts = false`` keeps them in bf16), both at
conversion (``convert_to_blockwise``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtrain.config import ConfigError, FP8Config
from dtrain.models.moe import GroupedExperts

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12  # torchao's floor on a group's absolute maximum (an all-zero group)


def _cast(values: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` times ``448 / amax`` (fp64, rounded to fp32), saturated and cast to e4m3, and
    the fp32 scale that dequantises them (that factor's reciprocal, about ``amax / 448``)."""
    factor = (E4M3_MAX / amax.clamp(min=EPS).double()).float()
    bits = (values * factor).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return bits, factor.reciprocal()


def quantize_tiles(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, cols) in 1x128 tiles along its rows: the e4m3 values (rows, cols) and one
    fp32 scale per tile (rows, ceil(cols / 128)); a last partial tile is scaled on its own."""
    rows, cols = t.shape
    padded = nn.functional.pad(t.float(), (0, -cols % BLOCK)).view(rows, -1, BLOCK)
    bits, scales = _cast(padded, padded.abs().amax(-1, keepdim=True))
    return bits.view(rows, -1)[:, :cols], scales.squeeze(-1)


def dequantize_tiles(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``quantize_tiles``' values back in fp32."""
    return bits.float() * scales.repeat_interleave(BLOCK, dim=1)[:, :bits.shape[1]]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (rows, cols) in 128x128 blocks: the e4m3 values (rows, cols) and one fp32 scale per
    block (ceil(rows / 128), ceil(cols / 128))."""
    rows, cols = w.shape
    padded = nn.functional.pad(w.float(), (0, -cols % BLOCK, 0, -rows % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    bits, scales = _cast(blocks, blocks.abs().amax(dim=(1, 3), keepdim=True))
    return bits.view(padded.shape)[:rows, :cols], scales[:, 0, :, 0]


def dequantize_blocks(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``quantize_blocks``' values back in fp32."""
    rows, cols = bits.shape
    full = scales.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return bits.float() * full[:rows, :cols]


def _tiles(t: torch.Tensor) -> torch.Tensor:
    return dequantize_tiles(*quantize_tiles(t))


def _blocks(w: torch.Tensor) -> torch.Tensor:
    return dequantize_blocks(*quantize_blocks(w))


class _BlockwiseMatmul(torch.autograd.Function):
    """``x W^T`` and its gradients, every operand cast as the recipe says (module docstring),
    the products in fp32 (autocast off inside: it would round the dequantised operands)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            out = _tiles(x.reshape(-1, x.shape[-1])) @ _blocks(weight).t()
        return out.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (_tiles(dy) @ _blocks(weight)).to(x.dtype).reshape(x.shape)
            if ctx.needs_input_grad[1]:  # tiles along the tokens, the sum's dimension
                tokens = x.reshape(-1, x.shape[-1]).t()
                grad_w = (_tiles(dy.t()) @ _tiles(tokens).t()).to(weight.dtype)
        return grad_x, grad_w, None


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) with the recipe's FP8 operands, emulated: ``x`` (...,
    in), ``weight`` (out, in). The output is in autocast's dtype where autocast is on (as
    torchao's bf16 output), else in ``x``'s; the gradients in their inputs' dtypes."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _BlockwiseMatmul.apply(x, weight, dtype)


class BlockwiseLinear(nn.Linear):
    """An ``nn.Linear`` without bias computed by ``blockwise_linear``: the emulated stand-in
    for torchao's ``Float8BlockwiseLinear`` (the CPU, ``fp8.emulate``). Its weight is the
    original layer's parameter; the state dict is a plain linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blockwise_linear(x, self.weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BlockwiseLinear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        return new


def blockwise_filter(convert: Callable[[nn.Module, str], bool]
                     ) -> Callable[[nn.Module, str], bool]:
    """``convert`` (``fp8_filter``'s predicate) narrowed to linears of whole 128x128 blocks
    without bias."""

    def whole_blocks(module: nn.Module, fqn: str) -> bool:
        return (convert(module, fqn) and module.in_features % BLOCK == 0
                and module.out_features % BLOCK == 0 and module.bias is None)

    return whole_blocks


def emulated(cfg: FP8Config) -> bool:
    """Whether the blockwise linears are dtrain's emulation: asked for, or no CUDA (torchao's
    kernels are Triton's, GPU only)."""
    return cfg.emulate or not torch.cuda.is_available()


def check_blockwise(cfg: FP8Config, device: torch.device | None, tp: int) -> None:
    """Refuses the blockwise recipe under tensor parallel and, unless emulated, on CUDA GPUs
    older than Hopper (torchao's blockwise GEMMs need compute capability 9.0). Off CUDA,
    ``dtrain.parallel.fp8.check_fp8`` refuses it without ``fp8.emulate``."""
    if tp > 1:
        raise ConfigError("fp8.recipe = 'blockwise' runs without tensor parallel (its linears "
                          "are not DTensor-aware): set parallel.tp = 1, or use fp8.recipe = "
                          "'rowwise'")
    if cfg.emulate or device is None or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (9, 0):
        raise ConfigError(f"fp8.recipe = 'blockwise' needs GPUs of compute capability 9.0 or "
                          f"newer (torchao's blockwise kernels) but "
                          f"{torch.cuda.get_device_name(device)} has "
                          f"{capability[0]}.{capability[1]}: use fp8.recipe = 'rowwise'")


def convert_to_blockwise(model: nn.Module, cfg: FP8Config, fsdp: bool,
                         convert: Callable[[nn.Module, str], bool]) -> list[str]:
    """Swaps, in place, the linears of ``model`` that ``convert`` (``blockwise_filter``'s)
    accepts for torchao's ``Float8BlockwiseLinear``, or ``BlockwiseLinear`` where ``emulated``;
    on a ``meta`` model nothing is allocated. Under FSDP (``fsdp``) the weights are gathered in
    high precision and cast in blocks after the gather (``fp8.fsdp_float8_all_gather`` is
    tensorwise's, as for rowwise). The MoE experts have no blockwise grouped GEMMs: they stay in
    bf16. Returns the names of the experts modules, for the start-up line."""
    experts = [name for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    if not emulated(cfg):
        from torchao.prototype.blockwise_fp8_training.linear import (
            Float8BlockwiseLinearConfig,
        )
        from torchao.quantization import quantize_

        quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=convert)
        return experts
    for name, module in list(model.named_modules()):
        if convert(module, name):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, BlockwiseLinear.from_linear(module))
    return experts


def describe_blockwise(cfg: FP8Config) -> str:
    """The recipe's words on the start-up line."""
    return ("blockwise (e4m3, 1x128 activation and gradient tiles, 128x128 weight blocks"
            + (", emulated)" if emulated(cfg) else ")"))
