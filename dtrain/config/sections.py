"""The run configuration's sections: one dataclass per TOML table, each field with its default,
its allowed range (``ranged``) and a docstring that ``python -m dtrain.train --help`` prints."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from dtrain.config.fields import ranged
from dtrain.config.model import ModelConfig


@dataclass
class JobConfig:
    name: str = "debug"
    """Run name; the run folder is ``<output_dir>/<name>``."""
    output_dir: str = "outputs"
    """Folder that holds one sub-folder per run (config.toml, tb/, metrics.jsonl)."""
    description: str = ""
    """Free text saved with the run."""
    overwrite: bool = False
    """Start a new run in a run folder that holds an earlier run's metrics (and no checkpoint
    to resume): its metrics.jsonl and tb/ are deleted first. Without it such a start is
    refused."""


@dataclass
class ParallelConfig:
    dp_replicate: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Data-parallel replicas (HSDP's replicate dimension)."""
    dp_shard: int = ranged(-1, lambda v: v == -1 or v >= 1, "-1 or an integer >= 1")
    """FSDP sharding degree; -1 takes the ranks the other degrees leave."""
    cp: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Context-parallel degree (sequence split across ranks inside attention)."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """With cp > 1, attention across the sequence shards: p2p (ring exchange of K/V overlapped
    with compute), all_gather (gather K/V), a2a (Ulysses: all-to-all to a head split; the heads
    per tensor-parallel rank must divide by cp)."""
    tp: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Tensor-parallel degree (with sequence parallel)."""
    pp: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Pipeline-parallel degree."""
    ep: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Expert-parallel degree, borrowed from dp_shard x cp."""
    fsdp_reshard_after_forward: Literal["auto", "default", "always", "never"] = "auto"
    """Free gathered weights after forward: always, never (more memory, less communication),
    default (every block but the last, whose weights backward needs first), or auto: default,
    then from the third step on CUDA the last blocks keep their gathered weights from forward to
    backward (no all-gather for their backward) as far as ``fsdp_auto_memory_fraction`` of the
    device's memory allows, measured on the second step."""
    fsdp_auto_memory_fraction: float = ranged(0.75, lambda v: 0 < v <= 1, "a number in (0, 1]")
    """With fsdp_reshard_after_forward = "auto": the share of the device's memory the allocated
    peak may reach with the blocks kept gathered (the allocator reserves more than it
    allocates: past about 0.8 it starts to release and retry, which stalls steps)."""
    fsdp_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the gradient reduce-scatter under bf16 mixed precision."""
    fsdp_cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""
    loss_parallel: bool = True
    """With tp > 1: compute the cross-entropy on vocabulary-sharded logits (never gathered)."""
    async_tp: bool = False
    """With tp > 1 on CUDA under compile: overlap TP communication with the matmuls."""
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                         "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    """Pipeline schedule (pp > 1); the interleaved ones need pp_virtual_stages > 1, the V ones 2."""
    pp_virtual_stages: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Pipeline stages per rank."""
    pp_layout: str = ""
    """Layers per stage, e.g. "E|t*4|t*4|L" (E embedding, t*N layers, L output; | between
    stages); "" splits the layers evenly."""


@dataclass
class TrainingConfig:
    steps: int = ranged(100, lambda v: v >= 1, "an integer >= 1")
    """Optimizer steps to run."""
    seq_len: int = ranged(256, lambda v: v >= 2, "an integer >= 2")
    """Tokens per sequence."""
    global_batch_size: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Sequences per optimizer step over all data-parallel ranks; 0 means
    micro_batch_size x data-parallel degree x grad_accum_steps."""
    micro_batch_size: int = ranged(1, lambda v: v >= 1, "an integer >= 1")
    """Sequences per forward/backward on one rank."""
    grad_accum_steps: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Micro-batches per optimizer step; 0 derives it from global_batch_size (or 1 if unset)."""
    max_norm: float = ranged(1.0, lambda v: v >= 0, "a number >= 0")
    """Clip the global gradient norm to this value (0 disables clipping)."""
    seed: int = 42
    """Seed for weight init and data order; the same seed gives the same run on any layout."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype; auto is bf16 on GPU and fp32 on CPU. Master weights stay fp32."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where to train; auto takes CUDA when present."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (slower)."""
    gc_interval: int = ranged(50, lambda v: v >= 0, "an integer >= 0 (0: automatic collection)")
    """Python's automatic garbage collection is off while training (its pauses would land at
    random inside steps, stalling the device's queue) and a young-generation collection runs
    every this many steps; 0 leaves Python's collector alone."""
    nonfinite: Literal["skip", "stop"] = "skip"
    """A step whose loss or gradient norm is infinite or NaN never changes the weights nor the
    optimizer state: skip (the run goes on; the next log line names the step) or stop (exit
    code 3 at the first one)."""
    max_nonfinite_steps: int = ranged(3, lambda v: v >= 1, "an integer >= 1")
    """With nonfinite = "skip": this many non-finite steps in a row stop the run (exit code 3)."""
    hang_timeout_s: float = ranged(1800.0, lambda v: v > 0, "a number of seconds > 0")
    """A training step (after the first 2 of a start) that makes no progress for this long is a
    hang: the rank writes every thread's stack to the run folder, names the rank that stopped
    and ends the job (exit code 4). Every collective times out a minute after the largest of
    hang_timeout_s, startup_timeout_s and save_timeout_s, as a last resort."""
    startup_timeout_s: float = ranged(3600.0, lambda v: v > 0, "a number of seconds > 0")
    """The hang allowance of start-up and compilation (from the start of training to the end of
    its first 2 steps: the first compiles, the second may recompile) and of every validation
    pass (the first compiles the evaluation graphs)."""
    save_timeout_s: float = ranged(3600.0, lambda v: v > 0, "a number of seconds > 0")
    """The hang allowance of a checkpoint save: its time grows with the model and the storage,
    not with the compiler, hence its own."""


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = ranged(3e-4, lambda v: v > 0, "a number > 0")
    """Peak learning rate."""
    betas: list[float] = ranged([0.9, 0.95], lambda v: len(v) == 2 and all(0 <= b < 1 for b in v),
                                "two numbers in [0, 1)")
    """Adam beta1, beta2."""
    eps: float = ranged(1e-8, lambda v: v > 0, "a number > 0")
    """Adam epsilon."""
    weight_decay: float = ranged(0.1, lambda v: v >= 0, "a number >= 0")
    """Decoupled weight decay on matrices (not on norms)."""
    implementation: Literal["auto", "fused", "foreach", "for-loop", "triton"] = "auto"
    """AdamW kernel; triton (CUDA) is torch's fused AdamW with dtrain's Triton kernel for the
    update, one launch a parameter; auto is triton on CUDA where Triton is installed and the
    parameters are on the GPU (fused otherwise, as with parallel.fsdp_cpu_offload), foreach on
    the CPU."""
    overlap_step: bool = True
    """On CUDA under FSDP (without pipeline parallel or CPU offload): run the step one FSDP unit
    at a time on a side stream, each unit's next all-gather waiting only for its own update, so
    that the updates overlap the next forward. On one GPU with the whole weights of a model,
    dense or MoE (no TP, EP, pipeline or Transformer Engine): the same block by block, each
    block's forward waiting for its own update. The same updates; off runs the step whole."""


@dataclass
class LRScheduleConfig:
    warmup_steps: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Linear warmup from lr/warmup_steps to lr."""
    decay: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """Shape after warmup; wsd holds lr then decays over the last wsd_decay_fraction of steps."""
    min_lr: float = ranged(0.0, lambda v: v >= 0, "a number >= 0")
    """Learning rate at the end of the decay (cosine, linear, wsd), absolute as Megatron-LM's
    --min-lr: at most optimizer.lr."""
    decay_steps: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """The step at which the decay ends (Megatron-LM's --lr-decay-iters); 0: training.steps.
    Steps after it train at min_lr."""
    wsd_decay_fraction: float = ranged(0.2, lambda v: 0 <= v <= 1, "a number in [0, 1]")
    """Fraction of the schedule's steps spent decaying in the wsd schedule."""
    wsd_decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """Decay curve of the wsd schedule's last phase."""
    override_checkpoint: bool = False
    """On resume, take this schedule where it differs from the checkpoint's (peak, floor,
    warm-up, shape, decay end), which is refused otherwise (Megatron-LM's
    --override-opt_param-scheduler)."""


@dataclass
class DataConfig:
    source: Literal["text", "hf", "indexed"] = "text"
    """text: one JSON-lines or text file, tokenized up front (small data); hf: HF datasets,
    streamed and tokenized on the fly (local JSON/JSONL/Parquet/text or a dataset name);
    indexed: Megatron-LM .bin/.idx prefixes, optionally a weighted blend."""
    path: str = "builtin:debug/corpus.jsonl"
    """text/hf: a file, folder or dataset name (``builtin:`` names a file shipped with dtrain);
    indexed: a prefix, or a Megatron-style blend "0.3 /data/a_text_document 0.7 /data/b"."""
    text_field: str = "text"
    """Field that holds the document text (text and hf sources)."""
    tokenizer: str = "builtin:debug/tokenizer.json"
    """HF tokenizer.json (or a folder holding one, or holding a GPT-2 vocab.json and
    merges.txt); with merge_file, a GPT-2 vocab.json (Megatron's --vocab-file). BOS/EOS come
    from tokenizer_config.json beside it."""
    merge_file: str = ""
    """A GPT-2 BPE merges.txt (Megatron's --merge-file): data.tokenizer is then its
    vocab.json, read as GPT-2's byte-level BPE (EOS <|endoftext|> unless eos_token says)."""
    bos_token: str = ""
    """BOS token text, overriding tokenizer_config.json ("" keeps it)."""
    eos_token: str = ""
    """EOS token text, overriding tokenizer_config.json ("" keeps it)."""
    vocab_size_divisible_by: int = ranged(128, lambda v: v >= 1, "an integer >= 1")
    """Pad the model's vocabulary to a multiple of this times the tensor-parallel degree."""
    hf_config: str = ""
    """hf source: the dataset's configuration name, if it has several."""
    hf_split: str = "train"
    """hf source: the dataset split to read."""
    split: str = "969,30,1"
    """indexed source: train/valid/test document split weights, as Megatron's --split."""
    index_cache: str = ""
    """indexed source: folder for the cached sample indices ("" = beside the data)."""


@dataclass
class ValidationConfig:
    enabled: bool = False
    """Evaluate the loss on held-out data every ``interval`` steps and at the last step."""
    interval: int = ranged(100, lambda v: v >= 1, "an integer >= 1")
    """Steps between evaluations."""
    steps: int = ranged(10, lambda v: v >= 1, "an integer >= 1")
    """Micro-batches per rank in each evaluation (the same ones every time)."""
    path: str = ""
    """Held-out data in the training source's format; "" takes the indexed source's valid
    split of data.path (text and hf sources need a path)."""


@dataclass
class CheckpointConfig:
    enabled: bool = False
    """Save distributed checkpoints and resume from the latest one at start-up."""
    folder: str = "checkpoints"
    """Folder inside the run folder (or an absolute path)."""
    interval: int = ranged(500, lambda v: v >= 1, "an integer >= 1")
    """Save every this many steps (and at the last step)."""
    keep_last: int = ranged(3, lambda v: v >= 0, "an integer >= 0")
    """Checkpoints to keep; older ones are deleted (0 keeps all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    load_step: int = ranged(0, lambda v: v >= 0, "an integer >= 0")
    """Resume from this step's checkpoint instead of the latest (0 = latest)."""
    initial_weights: str = ""
    """Start a new run from these model weights: a checkpoint made by ``python -m
    dtrain.convert_hf import``, or any dtrain checkpoint step folder (ignored when resuming a
    run)."""
    load_unverified: bool = False
    """Load a checkpoint without checking its files against the hashes recorded when they were
    written (for one whose hash records are missing or damaged); said at start-up."""
    reset_data_position: bool = False
    """On resume, start the data from its beginning instead of the saved position: for a
    resume whose data settings (data.source, data.path, data.tokenizer, training.seq_len, ...)
    differ from the checkpoint's, which is refused otherwise."""


@dataclass
class MetricsConfig:
    log_every: int = ranged(10, lambda v: v >= 1, "an integer >= 1")
    """Console line and TensorBoard scalars every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files into <run>/tb/<job.name> (a run named after the job):
    scalars grouped train/, perf/, memory/, moe/, and the resolved config as text."""
    peak_tflops: float = ranged(0.0, lambda v: v >= 0, "a number >= 0")
    """Peak bf16 TFLOP/s per device for MFU; 0 looks it up by device name."""


@dataclass
class ActivationCheckpointConfig:
    mode: Literal["none", "full", "layer", "op"] = "none"
    """none; full (recompute every block); layer (checkpoint every Nth block); op (selective by
    operator: keep attention and matmul outputs, recompute the cheap rest)."""
    every_n_layers: int = ranged(2, lambda v: v >= 1, "an integer >= 1")
    """For mode = "layer": checkpoint every this many blocks."""
    op_recompute_every_second_mm: bool = True
    """For mode = "op": recompute every second matmul too (less memory for a little compute)."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """torch.compile each transformer block and the loss."""
    tune_kernels: bool = False
    """Inductor's coordinate-descent tuning: each generated norm, activation and cast kernel
    has its block sizes searched on the GPU at its first compile (a longer first compile, then
    cached)."""
    tune_gemms: bool = False
    """The dense weights' GEMMs that add into fp32 .grad (bf16 and FP8, weights cast once per
    step) take the fastest of cuBLASLt's algorithms for their shapes, timed once per shape at
    the first step (with or without compile.enabled); not with training.deterministic (the
    choice may differ between runs). Off by default: not measured in training yet."""


@dataclass
class FP8Config:
    enabled: bool = False
    """Train the linear layers in FP8 (GPUs of compute capability 8.9 or newer: Ada, Hopper,
    Blackwell)."""
    backend: Literal["torchao", "te"] = "torchao"
    """torchao float8 (pip install dtrain[fp8]) or Transformer Engine (pip install dtrain[te])."""
    recipe: Literal["tensorwise", "rowwise", "blockwise", "delayed", "current"] = "tensorwise"
    """Scaling. torchao: tensorwise (fastest; FP8 all-gather under FSDP), rowwise (one scale
    per row, more accurate) or blockwise (DeepSeek-V3's: activations and gradients in 1x128
    tiles, weights in 128x128 blocks, a scale each, e4m3 throughout; Hopper; linears whose
    widths are multiples of 128; without TP, FP8 all-gather or FP8 experts); te: delayed
    (scales from an amax history) or current."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers kept in bf16: module names, dotted suffixes or globs (output,
    feed_forward.w2, layers.0.*). Layers whose dimensions are not multiples of 16 stay too.
    The output layer stays in bf16 by default, as in Megatron-LM and torchtitan; ``[]`` puts it
    in FP8 too (compiled with the blocks), as the Llama 3 8B recipe does: 5.2% faster on its
    bench, held-out loss 0.12% above bf16's after 300 steps against 0.04% with it kept
    (docs/benchmarks.md). On the command line: ``output,layers.0.*`` or ``'["output"]'``."""
    fsdp_float8_all_gather: bool = True
    """torchao tensorwise under FSDP: all-gather weights in FP8, with their scales computed in
    one all-reduce after each optimizer step (the other recipes gather in high precision)."""
    fused_weight_cast: bool = True
    """With FP8 all-gather: cast each weight shard to FP8 in one compiled kernel (the same bytes
    as torchao's three eager kernels; replaces torchao's method for the whole process)."""
    cast_weights_once_per_step: bool = True
    """Weights whole on each rank (no FSDP nor TP): cast each weight to FP8 once per optimizer
    step and use it in every micro-batch's forward and backward (torchao tensorwise: the same
    bits as a cast in each, and a column-major copy of them for the input gradient's product:
    2 bytes per converted parameter for the step; with one micro-batch a step the weight
    gradient's product writes the fp32 ``.grad`` itself, with several it adds into ``.grad``
    inside the GEMM on the GPU, cuBLASLt with beta 1; te: ``is_first_microbatch``)."""
    experts: bool = True
    """torchao: the MoE experts' grouped GEMMs in FP8 too (the forward and input-gradient
    products; rowwise scales, each expert's tokens padded to a multiple of 16 rows on the
    device; blockwise: the recipe's tiles and blocks for all three products, each expert's rows
    padded to a multiple of 128, dtrain's Triton grouped GEMMs on the GPU). Transformer Engine
    leaves the experts in bf16, said on the start-up line."""
    experts_weight_gradient: Literal["bf16", "fp8"] = "bf16"
    """torchao's FP8 experts (not blockwise), their weights cast once per step (whole on the
    rank: no FSDP, TP nor EP): the weight gradients' products in bf16, or in FP8 (tensorwise,
    the gradient e5m2 and the input e4m3 as torchao's linears take them, and as Transformer
    Engine's grouped linear does for Megatron), each expert's added into ``.grad`` inside
    cuBLASLt's GEMM. Elsewhere they stay bf16. Speed and loss: docs/benchmarks.md."""
    emulate: bool = False
    """torchao only: compute the FP8 matmuls in high precision, so the FP8 path (casts, scales,
    FP8 all-gather) runs on any device, the CPU included; for testing, not for speed. Blockwise
    is emulated by dtrain (the same tiles, blocks and scales; fp32 products)."""
    blockwise_gemm: Literal["triton", "cublaslt", "kernels"] = "triton"
    """The blockwise recipe's GEMMs on a Hopper GPU: triton (torchao's Float8BlockwiseLinear,
    the faster one measured: docs/benchmarks.md), cublaslt (dtrain's casts and cuBLASLt's
    blockwise-scaled GEMM through torch._scaled_mm, CUDA 12.9 or newer) or kernels (dtrain's
    casts and its Triton kernels, the experts' grouped GEMMs with one group: the block scales
    applied to each 128-wide slice of the sum, the weight gradient summed in fp32 in the
    kernel)."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(
        default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    fp8: FP8Config = field(default_factory=FP8Config)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Every section's set values (an unset key, None, is the preset's: left out)."""
        return {section: {key: value for key, value in values.items() if value is not None}
                for section, values in dataclasses.asdict(self).items()}

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {toml_value(value)}" for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)
