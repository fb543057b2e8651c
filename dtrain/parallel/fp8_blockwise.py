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
kernels do (``dtrain.kernels.blockwise_mm.quantize_tiles`` and ``quantize_blocks``): the factor
``448 / amax`` in fp64, rounded to fp32, multiplies the values (saturated to +-448, then cast)
and its fp32 reciprocal dequantises. Scales are not rounded to powers of two (Transformer
Engine's default rounds them; torchao and DeepSeek-V3's report do not).

On a Hopper GPU the linears become, by ``fp8.blockwise_gemm``, torchao's
``Float8BlockwiseLinear`` (``"triton"``: its Triton casts and GEMMs; the faster one measured)
or ``BlockwiseLinear`` with cuBLASLt's GEMMs (``"cublaslt"``) or dtrain's Triton kernels
(``"kernels"``). ``BlockwiseLinear``'s casts are plain torch code, which Inductor fuses into
the kernels around them when the blocks are compiled; each of its three products is one
``dtrain.kernels.blockwise_mm``: cuBLASLt's GEMM, which applies the scales inside its sums
(``torch._scaled_mm``'s blockwise scaling, as Transformer Engine's ``Float8BlockScaling`` on
Hopper), or, on the CPU and with ``fp8.emulate``, the dequantised operands multiplied in fp32:
the recipe's numerics, at high-precision speed. With ``"kernels"`` the products are the MoE
experts' grouped GEMMs with one group of all the tokens (``dtrain.kernels.grouped_blockwise``),
the weight gradient summed in fp32 inside its kernel.

A linear converts when ``fp8_filter`` lets it and both its widths are multiples of 128 (whole
blocks) and it has no bias; the rest stay in bf16 and the start-up line names them. Tensor
parallel is refused (``check_blockwise``). Under FSDP the weights are gathered in high
precision, then cast in blocks (FP8 all-gather is tensorwise's). The MoE experts of whole
blocks take the recipe too (``convert_to_blockwise``): on the GPU through dtrain's Triton
grouped GEMMs (``dtrain.kernels.grouped_blockwise``), emulated with ``fp8.emulate`` or on the
CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dtrain.config import ConfigError, FP8Config
from dtrain.kernels.blockwise_mm import (
    BLOCK,
    blockwise_gemm_works,
    blockwise_mm,
    quantize_blocks,
    quantize_tiles,
)
from dtrain.kernels.grouped_blockwise import (
    accumulate_grouped_blockwise,
    gpu_kernels_failure,
    grouped_blockwise_mm,
)
from dtrain.log import logger
from dtrain.models.moe import GroupedExperts

GEMMS = {"triton": "torchao's Triton GEMMs", "cublaslt": "cuBLASLt's GEMMs",
         "kernels": "dtrain's Triton GEMMs"}


def _one_group(rows: int, device: torch.device) -> torch.Tensor:
    """The groups' ends of the grouped kernels for ``rows`` rows as one group."""
    return torch.full((1,), rows, dtype=torch.int32, device=device)


def _product(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor,
             out_dtype: torch.dtype, emulate: bool, kernels: bool) -> torch.Tensor:
    """``a @ b^T`` (``blockwise_mm``'s contract): dtrain's grouped kernel where ``kernels``,
    else ``blockwise_mm``."""
    if kernels:
        ends = _one_group(a.shape[0], a.device)
        return grouped_blockwise_mm(a, a_scales, b[None], b_scales[None], ends, out_dtype, emulate)
    return blockwise_mm(a, a_scales, b, b_scales, out_dtype, emulate)


def _weight_product(g_t: torch.Tensor, g_scales: torch.Tensor, a_t: torch.Tensor,
                    a_scales: torch.Tensor, out_dtype: torch.dtype, emulate: bool,
                    kernels: bool) -> torch.Tensor:
    """``g_t @ a_t^T``, both in 128-token tiles along their rows: with ``kernels`` summed into
    fp32 inside dtrain's weight-gradient kernel, else ``blockwise_mm``."""
    if kernels:
        total = g_t.new_zeros(1, g_t.shape[0], a_t.shape[0], dtype=torch.float32)
        accumulate_grouped_blockwise(total, g_t, g_scales, a_t, a_scales,
                                     _one_group(g_t.shape[1], g_t.device), emulate)
        return total[0].to(out_dtype)
    return blockwise_mm(g_t, g_scales, a_t, a_scales, out_dtype, emulate)


class _BlockwiseMatmul(torch.autograd.Function):
    """``x W^T`` and its gradients, every operand cast as the recipe says (module docstring),
    each product one ``blockwise_mm`` (cuBLASLt's blockwise GEMM, or the dequantised product in
    fp32 where ``emulate``) or, with ``kernels``, dtrain's grouped kernels with one group. The
    weight is cast again in the backward rather than kept: its FP8 copy would live from each
    micro-batch's forward to its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                emulate: bool, kernels: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.gemm = (emulate, kernels)
        tokens = x.reshape(-1, x.shape[-1])
        out = _product(*quantize_tiles(tokens), *quantize_blocks(weight), out_dtype, emulate,
                       kernels)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        dy = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dy W: W^T's blocks are W's, transposed, cast anew
            grad_x = _product(*quantize_tiles(dy), *quantize_blocks(weight.t()), x.dtype,
                              *ctx.gemm).reshape(x.shape)  # (one fused kernel writes them)
        if ctx.needs_input_grad[1]:  # dy^T x: tiles along the tokens, the sum's dimension
            tokens = x.reshape(-1, x.shape[-1]).t()
            grad_w = _weight_product(*quantize_tiles(dy.t()), *quantize_tiles(tokens),
                                     weight.dtype, *ctx.gemm)
        return grad_x, grad_w, None, None, None


def blockwise_linear(x: torch.Tensor, weight: torch.Tensor, emulate: bool = True,
                     kernels: bool = False) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) with the recipe's FP8 operands: ``x`` (..., in),
    ``weight`` (out, in); emulated (fp32 products) unless ``emulate`` is false and the GPU runs
    cuBLASLt's blockwise GEMM, or with ``kernels`` dtrain's Triton kernels (on a GPU, or in
    Triton's interpreter). The output is in autocast's dtype where autocast is on, else in
    ``x``'s; the gradients in their inputs' dtypes."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _BlockwiseMatmul.apply(x, weight, dtype, emulate, kernels)


class BlockwiseLinear(nn.Linear):
    """An ``nn.Linear`` without bias computed by ``blockwise_linear``, emulated where
    ``emulate`` (the CPU, ``fp8.emulate``), by dtrain's kernels where ``kernels``. Its weight
    is the original layer's parameter; the state dict is a plain linear's."""

    emulate: bool = True
    kernels: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blockwise_linear(x, self.weight, self.emulate, self.kernels)

    @classmethod
    def from_linear(cls, linear: nn.Linear, emulate: bool = True,
                    kernels: bool = False) -> BlockwiseLinear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.emulate, new.kernels = emulate, kernels
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
    """Whether the blockwise products are emulated (fp32): asked for, or no CUDA."""
    return cfg.emulate or not torch.cuda.is_available()


def check_blockwise(cfg: FP8Config, device: torch.device | None, tp: int,
                    tokens: int | None = None) -> None:
    """Refuses the blockwise recipe under tensor parallel and, unless emulated: on CUDA GPUs
    older than Hopper; with ``fp8.blockwise_gemm = "cublaslt"`` where cuBLASLt's blockwise GEMM
    does not run (``blockwise_gemm_works``), with ``"kernels"`` where dtrain's Triton kernels
    fail their check (``gpu_kernels_failure``); and with ``tokens`` per micro-batch (on this rank:
    micro-batch x seq / cp) that are no multiple of 128 (the weight gradients' tiles) or,
    for cuBLASLt, 16 (the weight gradient's sum runs over them). Off CUDA,
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
                          f"newer (its blockwise GEMMs) but "
                          f"{torch.cuda.get_device_name(device)} has "
                          f"{capability[0]}.{capability[1]}: use fp8.recipe = 'rowwise'")
    if cfg.blockwise_gemm == "cublaslt" and not blockwise_gemm_works(device):
        raise ConfigError(f"fp8.blockwise_gemm = 'cublaslt' needs cuBLASLt's blockwise-scaled "
                          f"FP8 GEMM (torch._scaled_mm with 1x128 and 128x128 scales: Hopper, "
                          f"CUDA 12.9 or newer), which does not run on "
                          f"{torch.cuda.get_device_name(device)} with torch {torch.__version__} "
                          f"(CUDA {torch.version.cuda}): use fp8.blockwise_gemm = 'triton'")
    if cfg.blockwise_gemm == "kernels" and (failure := gpu_kernels_failure(device)):
        raise ConfigError(f"fp8.blockwise_gemm = 'kernels' needs dtrain's Triton kernels, which "
                          f"failed their check on {torch.cuda.get_device_name(device)} "
                          f"({failure}): use fp8.blockwise_gemm = 'triton'")
    cublaslt = cfg.blockwise_gemm == "cublaslt"
    multiple = 16 if cublaslt else BLOCK
    if tokens is not None and tokens % multiple:
        raise ConfigError(f"fp8.recipe = 'blockwise' needs the tokens of a micro-batch "
                          f"(training.micro_batch_size x training.seq_len / parallel.cp = "
                          f"{tokens}) to be a multiple of {multiple} on the GPU (the weight "
                          f"gradient's FP8 GEMM sums over them"
                          f"{'' if cublaslt else ' in 128-token tiles'}): change "
                          f"training.seq_len")


def convert_to_blockwise(model: nn.Module, cfg: FP8Config, fsdp: bool,
                         convert: Callable[[nn.Module, str], bool]
                         ) -> tuple[list[str], list[str]]:
    """Swaps, in place, the linears of ``model`` that ``convert`` (``blockwise_filter``'s)
    accepts: on a Hopper GPU for torchao's ``Float8BlockwiseLinear`` (``fp8.blockwise_gemm =
    "triton"``) or ``BlockwiseLinear`` with cuBLASLt's GEMMs (``"cublaslt"``), elsewhere for the
    emulated ``BlockwiseLinear``; on a ``meta`` model nothing is allocated. Under FSDP
    (``fsdp``) the weights are gathered in high precision and cast in blocks after the gather
    (``fp8.fsdp_float8_all_gather`` is tensorwise's, as for rowwise). The MoE experts whose
    widths are multiples of 128 take the recipe where ``fp8.experts`` is on (``blockwise``
    grouped GEMMs, ``dtrain.models.grouped_gemm``, or ``blockwise_emulated`` where the recipe
    is), unless the GPU kernels fail their check on this GPU (``gpu_kernels_failure``: then
    they stay in bf16, and a warning says why). Returns the names of the experts modules kept
    in bf16 and of those in FP8, for the start-up line."""
    emulate = emulated(cfg)
    kept, fp8 = [], []
    experts = [(name, m) for name, m in model.named_modules() if isinstance(m, GroupedExperts)]
    failure = None
    if experts and cfg.experts and not emulate:
        failure = gpu_kernels_failure(torch.device("cuda"))
        if failure:
            logger.warning(f"fp8: the experts stay in bf16: dtrain's blockwise grouped GEMMs "
                           f"failed their check on this GPU ({failure}); set fp8.experts = false "
                           f"to keep them in bf16 without the check")
    for name, module in experts:
        whole = not any(size % BLOCK for size in module.w1.shape[1:])
        if cfg.experts and whole and not failure:
            module.fp8 = "blockwise_emulated" if emulate else "blockwise"
            fp8.append(name)
        else:
            kept.append(name)
    if not emulate and cfg.blockwise_gemm == "triton":
        from torchao.prototype.blockwise_fp8_training.linear import (
            Float8BlockwiseLinearConfig,
        )
        from torchao.quantization import quantize_

        quantize_(model, Float8BlockwiseLinearConfig(), filter_fn=convert)
        return kept, fp8
    for name, module in list(model.named_modules()):
        if convert(module, name):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, BlockwiseLinear.from_linear(
                module, emulate, kernels=not emulate and cfg.blockwise_gemm == "kernels"))
    return kept, fp8


def describe_blockwise(cfg: FP8Config) -> str:
    """The recipe's words on the start-up line."""
    return ("blockwise (e4m3, 1x128 activation and gradient tiles, 128x128 weight blocks"
            + (", emulated)" if emulated(cfg) else f", {GEMMS[cfg.blockwise_gemm]})"))
