"""torch.compile per transformer block: each block compiles once and the graph is reused."""

from __future__ import annotations

import torch

from dtrain.models.llama import Transformer


def inductor_options(fp8: bool, tune_kernels: bool = False) -> dict[str, object]:
    """Inductor settings for the blocks' compiles. With FP8 linears, no mix-order reductions:
    Inductor otherwise fuses the RMSNorm backward with the FP8 cast of the normalised input
    into one kernel that writes the transposed FP8 copy byte by byte down its columns (1.9 ms
    per block and micro-batch for an 8192 x 4096 activation on an H200); kept apart, the cast
    is a tiled kernel of its own. Measured 5.1-5.6% more tokens/s, the same losses
    (docs/benchmarks.md). ``tune_kernels``: coordinate-descent tuning of each generated
    kernel's block sizes (``compile.tune_kernels``)."""
    from torch._inductor import config

    options: dict[str, object] = {}
    if fp8 and hasattr(config.triton, "mix_order_reduction"):
        options["triton.mix_order_reduction"] = False
    if tune_kernels:
        options["coordinate_descent_tuning"] = True
    return options


def fp8_output_layer(model: Transformer) -> bool:
    """Whether the output layer is a torchao FP8 linear (``fp8.filter_fqns`` without
    ``output``)."""
    if model.output is None or type(model.output).__name__ != "Float8Linear":
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(model.output, Float8Linear)


def apply_compile(model: Transformer, fullgraph: bool = True,
                  options: dict[str, object] | None = None) -> None:
    """Wraps each block (the multi-token prediction depths' too) in ``torch.compile`` (names
    gain ``_orig_mod``, which ``canonical_name`` removes) with Inductor's ``options`` for these
    compiles alone. Applied after checkpointing
    and before FSDP. ``fullgraph=False`` lets the block break around code compile must not
    trace (MoE layers' host reads of expert counts).

    An FP8 output layer is compiled too: its casts are those of a block's linears, but of a
    vocabulary-wide gradient (8192 x 128,256 for a Llama 3 sequence, 2.1 GB in bf16); left
    eager, its absolute maximum, scaling, saturation and the transposed copy are a pass each,
    which cost what its FP8 GEMMs save (docs/benchmarks.md). A bf16 output layer is one GEMM
    and stays as it is."""
    model.wrap_blocks(lambda i, block: torch.compile(block, fullgraph=fullgraph,
                                                     options=options or None))
    if fp8_output_layer(model):
        model.output = torch.compile(model.output, fullgraph=True, options=options or None)
