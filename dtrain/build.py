"""Building a run, one function per piece: the process group, the batch arithmetic, the model
(on ``meta``, converted, split into pipeline stages and parallelized) and the data loaders. Each
takes the config sections it needs and returns an object; the trainer (``dtrain.run``), the dry
run and the planner call them, and nothing here trains.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dtrain.config import (
    Config,
    ConfigError,
    DataConfig,
    TrainingConfig,
    ValidationConfig,
)
from dtrain.data.loader import Prefetcher, build_loader
from dtrain.data.tokenizer import Tokenizer, padded_vocab_size
from dtrain.lr_schedule import LRSchedule
from dtrain.metrics import model_flops_per_token
from dtrain.model_shape import describe_shape, model_args_of
from dtrain.models import LlamaArgs, Transformer
from dtrain.mtp import with_mtp
from dtrain.optim import build_optimizer
from dtrain.parallel import ParallelDims, describe_parallelize, inductor_options, parallelize
from dtrain.parallel.fp8 import convert_to_fp8, fp8_all_gather, fuse_fp8_weight_cast
from dtrain.parallel.pipeline import parse_layout, split_model, stages_of_rank
from dtrain.step import cross_entropy_sum, fused_cross_entropy_sum


def local_device(device_kind: str) -> torch.device:
    """The device this process trains on (``training.device``): its local rank's GPU when CUDA
    is there (or asked for), else the CPU. Raises ConfigError for 'cuda' without a GPU."""
    if device_kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA device is visible: use 'auto' "
                          "or 'cpu'")
    if device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def world_size() -> int:
    """The number of processes torchrun started (1 for a plain ``python`` process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: torch.device, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Joins the torchrun process group when there is one (NCCL on GPU, gloo on CPU), its
    collectives timing out after ``timeout_s``. Returns (rank, world size); a plain ``python``
    process is rank 0 of 1."""
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size() > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        given = {"store": store, "rank": int(os.environ["RANK"]), "world_size": world_size()} \
            if store is not None else {}
        dist.init_process_group(backend, device_id=device if use_cuda else None, timeout=timeout,
                                **given)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world_size()


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the launcher's store seen through a namespace of this restart attempt.

    torchrun (``--max-restarts``) restarts every worker after one fails, and the restarted
    workers rendezvous through the same store as the dead ones: a process group's keys (each
    rank's address) left by the last attempt would be read as this one's, and connecting to a
    dead rank fails (``Gloo connectFullMesh failed``). With each attempt's keys under its own
    prefix, a restart sees only its own workers. None outside torchrun: ``env://`` as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size(), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"dtrain/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


def batch_arithmetic(cfg: TrainingConfig, dp: int) -> tuple[int, int]:
    """(global batch, gradient-accumulation steps) from the recipe: global = micro x dp x accum.
    Raises ConfigError when the given numbers do not divide."""
    micro = cfg.micro_batch_size
    if cfg.global_batch_size == 0:
        accum = cfg.grad_accum_steps or 1
        return micro * dp * accum, accum
    per_step = micro * dp
    if cfg.global_batch_size % per_step:
        raise ConfigError(
            f"training.global_batch_size = {cfg.global_batch_size} is not divisible by "
            f"micro_batch_size x data-parallel degree = {micro} x {dp} = {per_step}: use a "
            f"multiple of {per_step} or change micro_batch_size")
    accum = cfg.global_batch_size // per_step
    if cfg.grad_accum_steps not in (0, accum):
        raise ConfigError(
            f"training.grad_accum_steps = {cfg.grad_accum_steps} disagrees with "
            f"global_batch_size / (micro_batch_size x dp) = {accum}: set one of them to 0")
    return cfg.global_batch_size, accum


@dataclasses.dataclass
class BuiltModel:
    """This rank's model parts, parallelized and still on ``meta``."""
    parts: list[Transformer]
    stage_indices: list[int]
    num_stages: int
    num_params: int
    flops_per_token: int
    compute_dtype: torch.dtype
    fp8_layers: tuple[list[str], list[str], list[str]] | None
    fp8_all_gather: bool
    features: list[str]  # the start-up summary's lines of what parallelize applied


def compute_dtype(cfg: TrainingConfig, device_type: str) -> torch.dtype:
    """bf16 where ``training.mixed_precision`` asks for it ('auto': on GPU), else fp32."""
    bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto"
                                             and device_type == "cuda")
    return torch.bfloat16 if bf16 else torch.float32


def build_model(cfg: Config, dims: ParallelDims, mesh: DeviceMesh | None, device_type: str,
                tokenizer_vocab: int, microbatches: int) -> BuiltModel:
    """The model of ``cfg.model`` on ``meta`` (vocabulary at least ``tokenizer_vocab``, padded
    to split over tp), converted to FP8 (``cfg.fp8``), split into this rank's pipeline stages
    (``microbatches`` per step) and parallelized over ``mesh``. Nothing is materialised: the
    trainer calls ``to_empty`` and ``init_weights``; the dry run counts the local shards. The
    config is assumed checked (``dtrain.checks.validate``)."""
    args = model_args_of(cfg.model, microbatches)
    # The embedding and output rows: at least the tokenizer's, padded so they split evenly
    # over tensor-parallel ranks; labels never use the padding rows.
    args.vocab_size = padded_vocab_size(max(args.vocab_size, tokenizer_vocab),
                                        cfg.data.vocab_size_divisible_by * dims.tp)
    with torch.device("meta"):
        model = Transformer(args)
    num_params = model.num_params()
    flops = model_flops_per_token(model, cfg.training.seq_len)
    fsdp = mesh is not None and dims.fsdp_enabled
    # (converted, kept) linear layer names; FP8 all-gather precomputes scales after each step.
    fp8_layers = convert_to_fp8(model, cfg.fp8, fsdp) if cfg.fp8.enabled else None
    all_gather = fp8_all_gather(cfg.fp8, fsdp)
    parts, stage_indices, num_stages = [model], [0], 1
    if dims.pp > 1:
        pcfg = cfg.parallel
        num_stages = dims.pp * pcfg.pp_virtual_stages
        specs = parse_layout(pcfg.pp_layout, args.n_layers, num_stages)
        stage_indices = stages_of_rank(dims.mesh("pp").get_local_rank(), dims.pp,
                                       pcfg.pp_virtual_stages, pcfg.pp_schedule)
        parts = split_model(model, specs, stage_indices)
    dtype = compute_dtype(cfg.training, device_type)
    # Each pipeline stage (or the whole model) is parallelized and initialised alike.
    parts = [parallelize(part, dims, mesh, cfg.parallel, cfg.activation_checkpoint, cfg.compile,
                         dtype, cfg.fp8, cfg.training.seq_len) for part in parts]
    if all_gather and cfg.fp8.fused_weight_cast:
        fuse_fp8_weight_cast(parts)
    features = [line] if (line := describe_shape(cfg.model)) else []
    features += describe_parallelize(dims, cfg.parallel, cfg.activation_checkpoint, cfg.compile,
                                     cfg.fp8, fp8_layers, all_gather)
    return BuiltModel(parts, stage_indices, num_stages, num_params, flops, dtype, fp8_layers,
                      all_gather, features)


def build_loss(cfg: Config, dims: ParallelDims, device: torch.device, args: LlamaArgs,
               tokens_per_step: int, groups: list[dist.ProcessGroup]):
    """The run's summed token loss ``(logits, labels) -> loss``: dtrain's fused kernel on CUDA,
    else PyTorch's (compiled under compile); with loss parallel (vocabulary-sharded logits
    under tensor parallel) PyTorch's, uncompiled. With multi-token prediction depths in the
    model ``args`` describes, the depths' losses join its gradient (``dtrain.mtp``; ``groups``:
    the ranks whose losses add up to a step's)."""
    sharded_loss = dims.tp > 1 and cfg.parallel.loss_parallel
    if cfg.model.triton_kernels and device.type == "cuda" and not sharded_loss:
        loss_fn = fused_cross_entropy_sum
    elif cfg.compile.enabled and not sharded_loss:
        loss_fn = torch.compile(cross_entropy_sum, options=inductor_options(
            False, cfg.compile.tune_kernels) or None)
    else:
        loss_fn = cross_entropy_sum
    return with_mtp(loss_fn, args.mtp_depths, args.mtp_loss_weight, tokens_per_step, groups,
                    device)


def build_optimizer_and_schedule(cfg: Config, parts: list[torch.nn.Module], device_type: str
                                  ) -> tuple[torch.optim.Optimizer, LRSchedule]:
    """The optimizer of ``cfg.optimizer`` over ``parts`` and its learning-rate schedule
    (``cfg.lr_schedule`` over ``cfg.training.steps``)."""
    optimizer = build_optimizer(parts, cfg.optimizer, device_type)
    return optimizer, LRSchedule(optimizer, cfg.lr_schedule, cfg.training.steps, cfg.optimizer.lr)


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    return Tokenizer(cfg.tokenizer, bos=cfg.bos_token or None, eos=cfg.eos_token or None,
                     merges=cfg.merge_file or None)


def data_settings(data: DataConfig, seq_len: int) -> dict[str, str]:
    """What a saved data position means: the settings of ``data.source`` that decide which
    windows a position indexes (a resume must have the same, ``dtrain.checkpoint``)."""
    keys = {"text": ("path", "tokenizer", "text_field", "bos_token", "eos_token"),
            "hf": ("path", "tokenizer", "text_field", "bos_token", "eos_token", "hf_config",
                   "hf_split"),
            "indexed": ("path", "split")}[data.source]
    if data.merge_file and data.source != "indexed":  # a GPT-2 pair: the merges count too
        keys += ("merge_file",)
    return {"data.source": data.source, "training.seq_len": str(seq_len),
            **{f"data.{key}": str(getattr(data, key)) for key in keys}}


def build_loaders(data: DataConfig, validation: ValidationConfig, training: TrainingConfig,
                  tokenizer: Tokenizer, dp_rank: int, dp: int, global_batch: int,
                  pin_memory: bool):
    """The training loader (prefetching in the background, into pinned memory for a GPU) and the
    validation loader: ``validation.path`` in the training source's format, or the indexed
    source's valid split; None when validation is off."""
    seq, micro, seed = training.seq_len, training.micro_batch_size, training.seed
    train = Prefetcher(build_loader(data, tokenizer, seq, micro, dp_rank, dp, seed,
                                    num_samples=training.steps * global_batch),
                       pin_memory=pin_memory)
    if not validation.enabled:
        return train, None
    data, split_name, key = validation_data(data, validation)
    samples = validation.steps * micro * dp
    return train, build_loader(data, tokenizer, seq, micro, dp_rank, dp, seed,
                               num_samples=samples, split_name=split_name, key=key)


def validation_data(data: DataConfig, validation: ValidationConfig
                    ) -> tuple[DataConfig, str, str]:
    """Where held-out data comes from: (the data section to read, the indexed split to take,
    the setting that names the path): ``validation.path`` in the training source's format, or
    the indexed source's valid split of ``data.path``."""
    if validation.path:
        return dataclasses.replace(data, path=validation.path, split="1,0,0"), "train", \
            "validation.path"
    return data, "valid", "data.path"
