"""The optimizer step taken one FSDP unit at a time (dtrain.parallel.overlap) gives the same
weights and optimizer state as the whole step, bit for bit; its units cover every parameter once,
in forward order. The side stream itself is CUDA-only (checked on the GPU: docs/benchmarks.md).
The ``auto`` reshard policy keeps the last blocks gathered as far as the headroom allows."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dtrain import Trainer, load_config
from dtrain.config import OptimizerConfig
from dtrain.models import build
from dtrain.optim import build_optimizer, clip_grad_norm_
from dtrain.parallel.fsdp import apply_fsdp, keep_gathered
from dtrain.parallel.overlap import OverlappedStep, fsdp_units, module_units, only, unit_groups


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_model(mesh):
    model = build("llama3_debug", device="cpu", seed=0, n_layers=3)
    apply_fsdp(model, mesh, torch.float32, torch.float32)
    return model


def test_units_cover_every_parameter_once_in_forward_order(mesh):
    model = sharded_model(mesh)
    units = fsdp_units([model])
    names = {id(p): n for n, p in model.named_parameters()}
    prefixes = [{names[id(p)].split(".")[0] + ("." + names[id(p)].split(".")[1]
                                                  if names[id(p)].startswith("layers") else "")
                 for p in params} for _, params in units]
    assert prefixes == [{"tok_embeddings"}, {"layers.0"}, {"layers.1"}, {"layers.2"},
                        {"norm", "output"}]
    flat = [id(p) for _, params in units for p in params]
    assert sorted(flat) == sorted(id(p) for p in model.parameters())
    assert all(state is not None for state, _ in units)


def test_only_narrows_the_step_and_restores_the_groups():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a, b], lr=1.0)
    a.grad = b.grad = torch.ones(2)
    assert unit_groups(opt, [b]) == [[b]]
    with only(opt, unit_groups(opt, [b])):
        opt.step()
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))
    assert opt.param_groups[0]["params"] == [a, b]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_unit_by_unit_step_equals_the_whole_step(mesh, impl):
    models = [sharded_model(mesh) for _ in range(2)]
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation=impl)
    opts = [build_optimizer(m, cfg, "cpu") for m in models]
    stepper = OverlappedStep(opts[0], [models[0]], torch.device("cpu"))
    assert len(stepper.units) == 5
    tokens = torch.randint(0, models[0].args.vocab_size, (2, 16), generator=torch.Generator()
                           .manual_seed(0))
    for _ in range(3):
        for model, opt in zip(models, opts, strict=True):
            model(tokens).float().square().mean().backward()
            clip_grad_norm_(list(model.parameters()), 0.5, optimizer=opt)
        stepper.step()
        opts[1].step()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got, want = opts[0].state[p][key], opts[1].state[q][key]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            want = want.full_tensor() if hasattr(want, "full_tensor") else want
            assert torch.equal(got, want), (name, key)


def test_keep_gathered_fills_the_headroom_from_the_last_block_back(mesh):
    model = sharded_model(mesh)  # 3 blocks: the last keeps its weights gathered already
    block_bytes = sum(p.numel() for p in model.layers["0"].parameters()) * 2  # in bf16

    def resharding() -> list[bool]:
        return [block._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                for block in model.layers.values()]

    assert resharding() == [True, True, False]
    assert keep_gathered(model, block_bytes - 1, torch.bfloat16) == 0
    assert resharding() == [True, True, False]
    assert keep_gathered(model, 2 * block_bytes - 1, torch.bfloat16) == 1
    assert resharding() == [True, False, False]
    assert keep_gathered(model, 10 * block_bytes, torch.bfloat16) == 2
    assert resharding() == [False, False, False]


# ---- without FSDP: block by block on one GPU ------------------------------------------------

def test_module_units_are_the_blocks_in_forward_order_and_tied_weights_stay_first():
    for tied in (False, True):
        model = build("llama3_debug", device="cpu", seed=0, n_layers=3, tie_embeddings=tied)
        units = module_units([model])
        names = {id(p): n.split(".") for n, p in model.named_parameters()}
        prefixes = [{".".join(names[id(p)][:2 if names[id(p)][0] == "layers" else 1])
                     for p in params} for _, params in units]
        assert prefixes == [{"tok_embeddings"}, {"layers.0"}, {"layers.1"}, {"layers.2"},
                            {"norm"}] + ([] if tied else [{"output"}])
        assert [m for m, _ in units][1:4] == list(model.layers.values())
        flat = [id(p) for _, params in units for p in params]
        assert sorted(flat) == sorted(id(p) for p in model.parameters())


BLOCKS = {"model.n_layers": 2, "training.seq_len": 64, "training.global_batch_size": 4,
          "training.micro_batch_size": 1, "training.steps": 3, "metrics.log_every": 1,
          "metrics.tensorboard": False}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 (the side stream); its output is in docs/benchmarks.md"))]


def train_counting_casts(trainer, hook_type, overlap: bool):
    """Trains ``trainer``, whose step hook of ``hook_type`` casts per unit exactly when the
    overlapped step is on (``overlap``): the losses and gradient norms, the weights after, and
    the number of layers each per-unit cast took."""
    hook = next(h for h in trainer.hooks.hooks if isinstance(h, hook_type))
    assert (trainer.overlapped_step is not None) is overlap
    assert (hook.per_unit is not None) is overlap
    casts = []
    if overlap:
        cast = hook.per_unit.cast
        hook.per_unit.cast = lambda members, cast=cast: casts.append(len(members)) or cast(members)
    history = trainer.train()
    return ([(r["loss"], r["grad_norm"]) for r in history],
            [p.detach().float().cpu() for p in trainer.model.parameters()], casts)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_block_by_block_step_with_casts_per_block_trains_exactly_as_the_whole_step(
        tmp_path, monkeypatch, device, precision):
    """One device, whole weights: the overlapped step updates block by block (on the GPU on a
    side stream, each block's forward waiting for its own update) and the step hooks cast each
    block's weights before its first forward (bf16 step weights; FP8 step casts): losses,
    gradient norms and weights equal the whole step's, bit for bit. On the CPU, where the run
    takes the whole step, the block-by-block path is switched on for the test. On the GPU,
    where attention's backward may sum in a different order from run to run, the whole step
    runs twice: where those two differ, the overlapped run may differ from them by as much."""
    from dtrain.run import Run
    from dtrain.step_weights.fp8_cast import StepWeightCast
    from dtrain.step_weights.linears import StepLinearWeights

    if device == "cpu":
        monkeypatch.setattr(Run, "whole_weights_on_gpu", lambda self: True)
    layout = {"bf16": {"training.mixed_precision": "bf16"},
              "fp8": {"fp8.enabled": True, "fp8.emulate": device == "cpu"}}[precision]
    hook_type = StepLinearWeights if precision == "bf16" else StepWeightCast
    runs = {}
    for overlap in (True, False) + ((None,) if device == "cuda" else ()):
        trainer = Trainer(load_config("debug", {
            **BLOCKS, **layout, "training.device": device,
            "optimizer.overlap_step": bool(overlap),
            "job.output_dir": str(tmp_path / str(overlap))}))
        if overlap:
            assert len(trainer.overlapped_step.units) == 5  # embedding, 2 blocks, norm, output
        figures, weights, casts = train_counting_casts(trainer, hook_type, bool(overlap))
        runs[overlap] = figures, weights
        if overlap:  # each block's 7 linears once a step (bf16: the output layer too)
            assert casts == ([7, 7, 1] if precision == "bf16" else [7, 7]) * 3

    def distance(a, b):  # the largest difference in the figures or any weight
        figures = max(abs(x - y) for fa, fb in zip(a[0], b[0], strict=True)
                      for x, y in zip(fa, fb, strict=True))
        weights = max((x - y).abs().max().item() for x, y in zip(a[1], b[1], strict=True))
        return max(figures, weights)

    noise = distance(runs[False], runs[None]) if device == "cuda" else 0.0
    assert distance(runs[True], runs[False]) <= noise


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_block_by_block_step_of_an_moe_model_trains_exactly_as_the_whole_step(
        tmp_path, monkeypatch, precision):
    """The same for a Mixtral-like model on one device: each block's experts are cast (bf16,
    or FP8 rowwise) before the block's first forward of the step, after its update, and their
    gradients are added into ``.grad`` in place as in the whole step: losses, gradient norms and
    weights equal the whole step's, bit for bit (on the CPU, the block-by-block path switched
    on for the test)."""
    from conftest import MIXTRAL_CPU

    from dtrain.run import Run
    from dtrain.step_weights.experts import StepExpertWeights

    monkeypatch.setattr(Run, "whole_weights_on_gpu", lambda self: True)
    layout = {"bf16": {"training.mixed_precision": "bf16", "model.moe_gemm": "grouped"},
              "fp8": {"fp8.enabled": True, "fp8.emulate": True}}[precision]
    runs = {}
    for overlap in (True, False):
        trainer = Trainer(load_config("debug", {
            **MIXTRAL_CPU, **layout, "training.steps": 3, "optimizer.overlap_step": overlap,
            "job.output_dir": str(tmp_path / str(overlap))}))
        figures, weights, casts = train_counting_casts(trainer, StepExpertWeights, overlap)
        runs[overlap] = figures, weights
        if overlap:  # each block's experts once a step, when the block first runs
            assert casts == [1, 1] * 3
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1], strict=True))
