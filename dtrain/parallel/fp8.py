"""FP8 training: the model's linear layers computed in float8, through torchao or Transformer
Engine, converted on the ``meta`` model before any parallelism.

torchao (``fp8.backend = "torchao"``): ``nn.Linear`` becomes torchao's ``Float8Linear``, which
casts its input, weight and output gradient to float8 with dynamic scales and runs the matmuls in
FP8; master weights, optimizer state and everything outside the linears stay as they were.
``tensorwise`` keeps one scale per tensor; under FSDP its weights are all-gathered in FP8 (half
the bytes of bf16), with the scales of all weights computed in one all-reduce after each optimizer
step (``precompute_fp8_scales``); under TP its activations are cast before the all-gather too.
``rowwise`` keeps a scale per row (more accurate, slower) and uses the plain TP styles.

Transformer Engine (``fp8.backend = "te"``): ``nn.Linear`` becomes ``te.Linear`` and each forward
of the model runs under ``te.fp8_autocast`` with the delayed or current scaling recipe.

``blockwise`` (``dtrain.parallel.fp8_blockwise``, under the torchao backend's settings) is
DeepSeek-V3's recipe: activations and gradients in 1x128 tiles, weights in 128x128 blocks,
each with its own scale, e4m3 throughout; it takes linears of whole blocks only, runs without
TP and FP8 all-gather, and takes the experts of whole blocks too (dtrain's blockwise grouped
GEMMs, ``dtrain.kernels.grouped_blockwise``).

With torchao, the MoE experts' grouped GEMMs run in FP8 as well (``fp8.experts``: rowwise
scales, ``dtrain.models.grouped_gemm``); Transformer Engine leaves them in bf16. DeepSeek-V3's
layers take the same rules: latent attention's projections are plain linears, its shared expert
a feed-forward, its routed experts grouped ones.

Layers stay in bf16 when their name matches ``fp8.filter_fqns`` (the output projection by
default), when their dimensions are not multiples of 16 (FP8 matmuls need them; an experts
module's too), when their weight is shared with another module (a tied output layer), or when
they are an MoE router's gate (its scores choose the experts: DeepSeek-V3, Megatron-LM and
torchtitan keep it in high precision). The start-up line names the kept ones and why.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import types
from collections import Counter
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dtrain.config import ConfigError, FP8Config
from dtrain.hooks import StepHook
from dtrain.kernels.lazy_compile import compile_on_first_call
from dtrain.models.moe import GroupedExperts, Router
from dtrain.parallel.fp8_blockwise import (
    blockwise_filter,
    check_blockwise,
    convert_to_blockwise,
    describe_blockwise,
)


def require_backend(backend: str):
    """Imports the backend (``torchao.float8`` or ``transformer_engine.pytorch``) and returns
    the module; raises ConfigError saying what to install when it is absent."""
    try:
        if backend == "torchao":
            import torchao.float8 as module
        else:
            import transformer_engine.pytorch as module
    except ImportError as e:
        top = "torchao" if backend == "torchao" else "transformer_engine"
        if not (isinstance(e, ModuleNotFoundError) and (e.name or top).split(".")[0] == top):
            raise ConfigError(f"fp8.backend = '{backend}': {top} is installed but does not "
                              f"import ({e}): reinstall it for this torch "
                              f"{torch.__version__}") from None
        if backend == "torchao":
            raise ConfigError("fp8.backend = 'torchao' needs torchao, which is not installed: "
                              "pip install 'dtrain[fp8]' (or pip install torchao), or set "
                              "fp8.enabled = false") from None
        raise ConfigError("fp8.backend = 'te' needs Transformer Engine, which is not installed: "
                          "pip install 'dtrain[te]' (on a machine with CUDA; see Transformer "
                          "Engine's installation guide), or use fp8.backend = 'torchao'") from None
    return module


def check_fp8(cfg: FP8Config, device: torch.device | None, tp: int,
              tokens: int | None = None) -> None:
    """Refuses FP8 where it cannot run: off CUDA, on GPUs older than compute capability 8.9
    (unless emulated), without the backend installed, and TE with tensor parallel.
    ``device`` None (a dry run, planning for GPUs it does not have) skips the device's checks.
    The blockwise recipe's own refusals (``tokens``: of a micro-batch on one rank):
    ``fp8_blockwise.check_blockwise``."""
    if cfg.recipe == "blockwise":
        check_blockwise(cfg, device, tp, tokens)
    if cfg.emulate:
        if cfg.backend != "torchao":
            raise ConfigError("fp8.emulate = true is a torchao option: set fp8.backend = "
                              "'torchao' or fp8.emulate = false")
        require_backend(cfg.backend)
        return
    if device is not None and device.type != "cuda":
        raise ConfigError("fp8.enabled = true needs CUDA GPUs of compute capability 8.9 or newer "
                          "(Ada, Hopper, Blackwell) but this run is on the CPU: set "
                          "fp8.enabled = false")
    capability = torch.cuda.get_device_capability(device) if device is not None else (9, 0)
    if capability < (8, 9):
        raise ConfigError(f"fp8.enabled = true needs GPUs of compute capability 8.9 or newer "
                          f"(Ada, Hopper, Blackwell) but {torch.cuda.get_device_name(device)} "
                          f"has {capability[0]}.{capability[1]}: set fp8.enabled = false")
    if cfg.backend == "te" and tp > 1:
        raise ConfigError("fp8.backend = 'te' runs without tensor parallel (TE's modules are "
                          "not DTensor-aware): set parallel.tp = 1, or use fp8.backend = "
                          "'torchao'")
    require_backend(cfg.backend)


def eager_fp8_warning(cfg: FP8Config, compiled: bool) -> str | None:
    """The warning for torchao FP8 without ``torch.compile``, which is slower than bf16: its
    casts and scales run as separate eager kernels around every matmul. None otherwise (and for
    emulated FP8, which is for machines without FP8 units)."""
    if not cfg.enabled or cfg.backend != "torchao" or compiled or cfg.emulate:
        return None
    return ("warning: fp8 with torchao runs slower than bf16 without torch.compile (10,633 "
            "against 17,003 tok/s, Llama 3 8B shapes on one H200): its casts run as separate "
            "kernels; set compile.enabled = true, or fp8.backend = 'te' for eager FP8")


def _matches(fqn: str, pattern: str) -> bool:
    return fqn == pattern or fqn.endswith("." + pattern) or fnmatch.fnmatchcase(fqn, pattern)


def fp8_filter(model: nn.Module, filter_fqns: Sequence[str]) -> Callable[[nn.Module, str], bool]:
    """The predicate ``(module, fqn) -> convert?``: true for an ``nn.Linear`` of ``model`` whose
    name matches no pattern of ``filter_fqns`` (a name, a dotted suffix or a glob), whose
    in and out features are multiples of 16, whose weight no other module shares and which is
    no MoE router's gate."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    gates = {id(m.gate) for m in model.modules() if isinstance(m, Router)}

    def convert(module: nn.Module, fqn: str) -> bool:
        return (isinstance(module, nn.Linear)
                and not any(_matches(fqn, pattern) for pattern in filter_fqns)
                and module.in_features % 16 == 0 and module.out_features % 16 == 0
                and uses[id(module.weight)] == 1 and id(module) not in gates)

    return convert


def fp8_all_gather(cfg: FP8Config, fsdp: bool) -> bool:
    """Whether FSDP all-gathers the converted weights in FP8 (torchao tensorwise only)."""
    return (cfg.enabled and fsdp and cfg.backend == "torchao" and cfg.recipe == "tensorwise"
            and cfg.fsdp_float8_all_gather)


def float8_tensor_parallel(cfg: FP8Config | None) -> bool:
    """Whether tensor parallel uses torchao's float8 styles (tensorwise scaling only)."""
    return (cfg is not None and cfg.enabled and cfg.backend == "torchao"
            and cfg.recipe == "tensorwise")


def convert_to_fp8(model: nn.Module, cfg: FP8Config,
                   fsdp: bool) -> tuple[list[str], list[str], list[str]]:
    """Swaps, in place, the ``nn.Linear`` layers of ``model`` that pass ``fp8_filter`` for FP8
    ones of ``cfg.backend``; on a ``meta`` model nothing is allocated. ``fsdp`` turns on FP8
    all-gather where ``fp8_all_gather`` says so; ``cfg.emulate`` (torchao) computes the FP8
    matmuls in high precision, for machines without FP8 units. Returns the names of the
    converted linear layers, of the layers kept as they were (linears, and with ``fp8.experts``
    the MoE experts modules whose widths FP8 cannot take) and of the experts modules whose
    grouped GEMMs run in FP8. The blockwise recipe converts linears and experts modules of
    whole 128x128 blocks (``fp8_blockwise.convert_to_blockwise``)."""
    convert = fp8_filter(model, cfg.filter_fqns)
    if cfg.recipe == "blockwise":
        convert = blockwise_filter(convert)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = [name for name, m in linears if convert(m, name)]
    kept = [name for name, m in linears if not convert(m, name)]
    if cfg.recipe == "blockwise":
        kept_experts, experts = convert_to_blockwise(model, cfg, fsdp, convert)
        return converted, kept + kept_experts, experts
    backend = require_backend(cfg.backend)
    experts: list[str] = []
    if cfg.backend == "torchao":
        config = backend.Float8LinearConfig.from_recipe_name(cfg.recipe)
        config = dataclasses.replace(
            config, enable_fsdp_float8_all_gather=fp8_all_gather(cfg, fsdp), emulate=cfg.emulate)
        backend.convert_to_float8_training(model, config=config, module_filter_fn=convert)
        if cfg.experts:
            experts = _fp8_experts(model, cfg.emulate, cfg.experts_weight_gradient == "fp8")
            kept += [name for name, m in model.named_modules()
                     if isinstance(m, GroupedExperts) and name not in experts]
    else:
        for name in converted:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, _te_linear(backend, getattr(parent, child)))
        _forward_under_te_autocast(model, backend, cfg.recipe)
    return converted, kept, experts


def _fp8_experts(model: nn.Module, emulate: bool, fp8_weight_gradient: bool) -> list[str]:
    """Puts the grouped GEMMs of every MoE experts module of ``model`` whose dimensions are
    multiples of 16 (as FP8 GEMMs need) in FP8 (``dtrain.models.grouped_gemm``), their weight
    gradients too where ``fp8_weight_gradient`` (those added into ``.grad`` in place); returns
    their names."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and not any(
                size % 16 for size in module.w1.shape[1:]):
            module.fp8 = "fp8_emulated" if emulate else "fp8"
            module.fp8_weight_gradient = fp8_weight_gradient
            names.append(name)
    return names


def _te_forward(self, inp: torch.Tensor) -> torch.Tensor:
    """``te.Linear.forward``, kept outside any compiled graph by ``_te_linear`` (torch.compile
    traces the rest of the block around it), told whether this is the step's first micro-batch
    while training: TE casts the weight to FP8 in the first and reuses that cast in the step's
    later forwards and backwards (``is_first_microbatch``; ``TEFirstMicrobatch`` sets the flag
    before each step). Evaluation and forwards outside steps cast afresh."""
    first = self._first_microbatch if torch.is_grad_enabled() else None
    if first:
        self._first_microbatch = False
    return type(self).forward(self, inp, is_first_microbatch=first)


def _te_linear(te, linear: nn.Linear) -> nn.Module:
    """A ``te.Linear`` of the same shape, its forward kept out of torch.compile's graphs
    (``_te_forward``); weights are copied unless on ``meta``."""
    device = linear.weight.device
    new = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    params_dtype=linear.weight.dtype, device=device)
    new._first_microbatch = None
    # disabled here, not at import: building the wrapper imports Dynamo (lazy_compile's why)
    new.forward = types.MethodType(torch.compiler.disable(_te_forward), new)
    if device.type != "meta":
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
    return new


def te_linears(model_parts: Sequence[nn.Module]) -> list[nn.Module]:
    """The TE linear layers ``convert_to_fp8`` made in ``model_parts``."""
    return [m for part in model_parts for m in part.modules() if hasattr(m, "_first_microbatch")]


def next_forward_is_first(linear: nn.Module) -> bool | None:
    """The flag the next forward of the TE linear ``linear`` gives TE: True for the step's first
    micro-batch (cast the weight), False for the later ones (reuse it), None outside a step."""
    return linear._first_microbatch


class TEFirstMicrobatch(StepHook):
    """Marks the next forward of each TE linear of ``linears`` as the step's first micro-batch
    (TE casts its weight to FP8 there and reuses the cast for the rest of the step). For
    weights whole on the rank: under FSDP each forward gathers them anew."""

    def describe(self) -> str:
        return (f"{len(self.linears)} Transformer Engine linears cast to FP8 once per step "
                f"(TE's first micro-batch)")

    def __init__(self, linears: Sequence[nn.Module]):
        self.linears = list(linears)

    def before_step(self) -> None:
        for linear in self.linears:
            linear._first_microbatch = True

    def before_update(self) -> None:
        for linear in self.linears:
            linear._first_microbatch = None

    def abandon_step(self) -> None:
        self.before_update()


def _forward_under_te_autocast(model: nn.Module, te, recipe_name: str) -> None:
    """Runs each forward of ``model`` (of each pipeline stage copied from it) under
    ``te.fp8_autocast``; backward follows the recipe TE recorded in forward."""
    from transformer_engine.common import recipe

    fp8_recipe = (recipe.DelayedScaling() if recipe_name == "delayed"
                  else recipe.Float8CurrentScaling())
    contexts = []

    def enter(module, args):
        contexts.append(te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)


def precompute_fp8_scales(model_parts: Sequence[nn.Module]) -> None:
    """After an optimizer step under FP8 all-gather: the scales of every FP8 weight, from the
    sharded weights' absolute maxima in one all-reduce, for the next step's all-gathers."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


class UnitScales:
    """``precompute_fp8_scales`` one FSDP unit at a time, for the overlapped optimizer step
    (``dtrain.parallel.overlap``): called with a unit's parameters right after their update, it
    sets the scales of the FP8 weights among them. The values are torchao's (the weights'
    absolute maxima, all-reduced with max, through torchao's ``amax_to_scale``), but the
    all-reduce runs over ``group``, a communicator of its own: on FSDP's, these small
    reductions would queue behind the all-gathers of the next forward, and the first all-gather
    behind the last unit's update. Max over ranks holding copies changes nothing, so ``group``
    may be any set of ranks that covers every shard of every weight, all of them holding the
    same units (no pipeline parallel), the whole world included."""

    def __init__(self, model_parts: Sequence[nn.Module], group):
        from torch.distributed.tensor import DTensor
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        self.group = group
        self.linears = {
            id(m.weight): m for part in model_parts for m in part.modules()
            if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor)
            and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)}

    @torch.no_grad()
    def __call__(self, params: Sequence[nn.Parameter]) -> None:
        import torch.distributed as dist
        from torchao.float8.float8_utils import amax_to_scale

        linears = [self.linears[id(p)] for p in params if id(p) in self.linears]
        if not linears:
            return
        (target,) = {m.config.cast_config_weight.target_dtype for m in linears}
        local = [m.weight._local_tensor for m in linears]
        amax = torch.stack(torch._foreach_norm(local, ord=float("inf")))
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        scale = amax_to_scale(amax, target)
        for i, linear in enumerate(linears):
            linear.weight._local_tensor._precomputed_scale = scale[i]


class ScaleRefresh(StepHook):
    """Under FP8 all-gather with the whole optimizer step: every FP8 weight's scale after each
    update (``precompute_fp8_scales``), for the next step's all-gathers. (The overlapped step
    refreshes them unit by unit instead: ``UnitScales``.)"""

    def __init__(self, model_parts: Sequence[nn.Module]):
        self.model_parts = model_parts

    def after_update(self) -> None:
        precompute_fp8_scales(self.model_parts)


def describe_fp8(cfg: FP8Config, layers: tuple[list[str], list[str], list[str]],
                 all_gather: bool) -> str:
    """The start-up summary's line of the FP8 conversion (``convert_to_fp8``'s ``layers``:
    converted linears, kept layers, MoE layers whose experts are FP8): what runs in FP8, and
    each kind of layer kept in bf16 (``kept_summary``)."""
    converted, kept, experts = layers
    blockwise = cfg.recipe == "blockwise"
    recipe = describe_blockwise(cfg) if blockwise else cfg.recipe
    return (f"fp8: {cfg.backend} {recipe}{' with FP8 all-gather' if all_gather else ''} | "
            f"{len(converted)} linear layers in FP8"
            + (f", the experts of {len(experts)} MoE layers "
               f"({'blockwise' if blockwise else 'rowwise'}"
               f"{_experts_weight_gradient(cfg)})" if experts else "")
            + f" | kept in bf16: {kept_summary(kept, cfg.filter_fqns, blockwise) or 'none'}")


def _experts_weight_gradient(cfg: FP8Config) -> str:
    fp8 = cfg.experts_weight_gradient == "fp8" and cfg.recipe != "blockwise"
    return ", weight gradients tensorwise where added into .grad in place" if fp8 else ""


def kept_summary(kept: Sequence[str], filter_fqns: Sequence[str], blockwise: bool = False) -> str:
    """``kept`` (layer names) by kind and why, the blocks' (and multi-token prediction depths')
    layers under one pattern with their number: "layers.*.attention.wkv_a x2 (widths not
    multiples of 16, or a shared weight), output (fp8.filter_fqns)". ``blockwise``: the
    blockwise recipe's reasons (whole 128x128 blocks, no bias, no FP8 experts)."""
    kinds: dict[tuple[str, str], int] = {}
    for name in kept:
        if any(_matches(name, pattern) for pattern in filter_fqns):
            why = "fp8.filter_fqns"
        elif name.endswith("router.gate"):
            why = "MoE router"
        elif name.endswith("experts"):
            why = ("widths not multiples of 128, fp8.experts off, or the GPU kernels' check "
                   "failed") if blockwise else "widths not multiples of 16"
        elif blockwise:
            why = "widths not multiples of 128, a bias, or a shared weight"
        else:
            why = "widths not multiples of 16, or a shared weight"
        kind = (re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", name), why)
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{kind}{f' x{n}' if '*' in kind else ''} ({why})"
                     for (kind, why), n in kinds.items())


def fp8_step_hooks(model_parts: Sequence[nn.Module], cfg: FP8Config, fsdp: bool,
                   all_gather: bool, overlap: bool) -> list[StepHook]:
    """The step hooks of FP8 outside ``dtrain.step_weights``: Transformer Engine's first
    micro-batch flag (its own weight cast once per step, for weights whole on the rank: under
    FSDP each forward gathers them anew), and the FP8 all-gather's scales after the whole
    optimizer step (the overlapped step refreshes them unit by unit: ``UnitScales``)."""
    hooks: list[StepHook] = []
    if cfg.enabled and cfg.backend == "te" and cfg.cast_weights_once_per_step and not fsdp:
        if linears := te_linears(model_parts):
            hooks.append(TEFirstMicrobatch(linears))
    if all_gather and not overlap:
        hooks.append(ScaleRefresh(model_parts))
    return hooks


@compile_on_first_call(fullgraph=True, dynamic=False)
def _cast(shard: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's own steps (``hp_tensor_and_scale_to_float8``): scale in fp32, saturate,
    convert; compiled into one kernel."""
    from torchao.float8.float8_utils import to_fp8_saturated

    return to_fp8_saturated(shard.to(torch.float32) * scale, dtype)


def _fused_pre_all_gather(weight, mesh):
    """``fsdp_pre_all_gather`` of one weight shard: with a precomputed scale, one fused cast;
    without, torchao's own method."""
    scale = weight._precomputed_scale
    if scale is None:
        return type(weight).fsdp_pre_all_gather(weight, mesh)
    return (_cast(weight._tensor, scale, weight._dtype),), (scale,)


def fuse_weight_cast(weight: torch.Tensor) -> None:
    """Makes FSDP cast this weight shard (a torchao ``WeightWithDynamicFloat8CastTensor``) to FP8
    in one compiled kernel before its all-gather, where torchao's method runs three eager
    kernels with fp32 intermediates (scale, clamp, convert), for every weight at every forward
    and backward all-gather. The values are the same. Set on this tensor alone: torchao's class
    and every other tensor keep torchao's method. Calling it again does nothing."""
    if "fsdp_pre_all_gather" not in vars(weight):
        weight.fsdp_pre_all_gather = types.MethodType(_fused_pre_all_gather, weight)


def fuse_fp8_weight_cast(model_parts: Sequence[nn.Module]) -> None:
    """``fuse_weight_cast`` for the FP8 weights of ``model_parts`` (under FSDP, with FP8
    all-gather: ``fp8.fused_weight_cast``). FSDP replaces a weight's shard tensor when it
    materialises or first runs the model, so the cast is set on the current shards in a hook
    before each unit's own all-gather (after the root's first-forward initialisation), a
    dictionary lookup per weight when it is set already."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear

    def install(linears: list[nn.Module]):
        def hook(module: nn.Module, args) -> None:
            for linear in linears:
                fuse_weight_cast(linear.weight._local_tensor)
        return hook

    for part in model_parts:
        for module in part.modules():
            if module is part or not isinstance(module, FSDPModule):
                continue
            linears = [m for m in module.modules() if isinstance(m, Float8Linear)
                       and isinstance(m.weight, DTensor)]
            if linears:
                module.register_forward_pre_hook(install(linears), prepend=True)
