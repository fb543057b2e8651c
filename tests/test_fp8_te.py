"""The Transformer Engine backend (``fp8.backend = "te"``) on an FP8 GPU: compiled blocks with
TE's linears kept out of the graphs train like the eager model, and under gradient accumulation
each TE linear is told the step's first micro-batch once per step. Skipped (reported as such)
where Transformer Engine or an FP8 GPU is missing; the output on the H200 is in
docs/benchmarks.md."""

import pytest
import torch

from dtrain import Trainer, load_config
from dtrain.parallel.fp8 import next_forward_is_first, te_linears


def te_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not te_available(),
                                reason="needs Transformer Engine and a GPU with FP8")

TE = {"fp8.enabled": True, "fp8.backend": "te", "training.device": "cuda", "model.n_layers": 2,
      "training.seq_len": 256, "training.global_batch_size": 8, "training.micro_batch_size": 2,
      "training.steps": 4, "metrics.log_every": 1, "metrics.tensorboard": False}


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_te_blocks_train_like_eager_ones(tmp_path, recipe):
    import transformer_engine.pytorch as te

    losses = {}
    for compiled in (False, True):
        trainer = Trainer(load_config("debug", {
            **TE, "fp8.recipe": recipe, "compile.enabled": compiled,
            "job.output_dir": str(tmp_path / str(compiled))}))
        linears = te_linears(trainer.model_parts)
        assert len(linears) == 2 * 7 and all(isinstance(m, te.Linear) for m in linears)
        firsts = []
        if not compiled:  # the flag each TE forward was given (eager: hooks see every call)
            for m in linears:
                m.register_forward_pre_hook(lambda module, args, firsts=firsts:
                                            firsts.append(next_forward_is_first(module)))
        losses[compiled] = [r["loss"] for r in trainer.train()]
        if not compiled:  # 4 micro-batches a step: the first told so, the other three not
            assert firsts == ([True] * 14 + [False] * 14 * 3) * 4
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
    assert losses[True][-1] < losses[True][0]


@pytest.mark.parametrize("compiled", [False, True])
def test_te_checkpoints_resume_and_load_into_torchao_and_bf16_and_back(tmp_path, monkeypatch,
                                                                      compiled):
    """Eager and compiled (module names then carry ``_orig_mod``). A TE run (delayed scaling:
    its amax histories are state) saves at step 2; it resumes with its scaling state, and the
    same checkpoint loads into torchao FP8 and bf16 runs; a torchao checkpoint loads into TE.
    Every resumed run continues from the saved weights: its step-3 loss is within 2% of the
    uninterrupted TE run's (the torchao and bf16 runs compute that step in another precision,
    so not bitwise; a wrong or missing weight would be far off). (TE
    unpickles its scaling state only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.)"""
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    ckpt = {**TE, "fp8.recipe": "delayed", "checkpoint.enabled": True, "checkpoint.interval": 2,
            "compile.enabled": compiled}
    layouts = {"te": {}, "torchao": {"fp8.backend": "torchao", "fp8.recipe": "tensorwise"},
               "bf16": {"fp8.enabled": False}}

    def run(folder, layout, **extra):
        return Trainer(load_config("debug", {**ckpt, **layouts[layout], **extra,
                                             "job.output_dir": str(tmp_path / folder)}))

    reference = [r["loss"] for r in run("ref", "te", **{"checkpoint.enabled": False}).train()]
    first = run("te", "te")
    first.train(until=2)
    saved = {k: v for k, v in first.model.state_dict().items() if k.endswith("_extra_state")}
    assert len(saved) == 14 and all(v.numel() > 0 for v in saved.values())

    def scaling(run):  # each TE linear's forward scales and amax history (delayed scaling)
        return [(m.fp8_meta["scaling_fwd"].scale.clone(),
                 m.fp8_meta["scaling_fwd"].amax_history.clone())
                for m in te_linears(run.model_parts)]

    saved_scaling = scaling(first)
    for layout in layouts:
        resumed = run("te", layout, **{"checkpoint.load_step": 2})
        assert resumed.step == 2
        if layout == "te":  # the amax histories and scales come back
            assert all(torch.equal(a, b) and torch.equal(h, g) for (a, h), (b, g)
                       in zip(scaling(resumed), saved_scaling, strict=True))
        losses = [r["loss"] for r in resumed.train(until=3)]
        assert losses == pytest.approx(reference[2:3], rel=2e-2)
    run("ao", "torchao").train(until=2)
    back = run("ao", "te")
    assert back.step == 2
    assert [r["loss"] for r in back.train(until=3)] == pytest.approx(reference[2:3], rel=2e-2)


def test_te_linears_train_under_fsdp2_like_the_unsharded_model():
    """TE's linears under dtrain's FSDP2 units (``apply_fsdp`` on a one-rank mesh: FSDP2's
    parameter swapping, bf16 compute and fp32 gradient reduction, as on any data-parallel
    layout; more ranks need more GPUs than one) train like the unsharded TE model under
    autocast, for both recipes: within 2% over 4 steps (FSDP rounds the weights to bf16 before
    TE's cast, autocast inside it, and TE's kernels are not bitwise reproducible)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dtrain.config import FP8Config
    from dtrain.models.llama import LlamaArgs, Transformer
    from dtrain.parallel.fp8 import convert_to_fp8
    from dtrain.parallel.fsdp import apply_fsdp

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=0,
                                world_size=1)
    tokens = torch.randint(0, 1024, (4, 8, 257), generator=torch.Generator().manual_seed(0))
    try:
        for recipe in ("delayed", "current"):
            losses = {}
            for fsdp in (False, True):
                with torch.device("meta"):
                    model = Transformer(LlamaArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                                                  vocab_size=1024, max_seq_len=256))
                converted, _, _ = convert_to_fp8(model, FP8Config(
                    enabled=True, backend="te", recipe=recipe), fsdp)
                assert len(converted) == 14
                if fsdp:
                    apply_fsdp(model, init_device_mesh("cuda", (1,)), torch.bfloat16,
                               torch.float32)
                model.to_empty(device="cuda")
                model.init_weights(0)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                losses[fsdp] = []
                for batch in tokens.cuda():
                    with torch.autocast("cuda", torch.bfloat16, enabled=not fsdp):
                        logits = model(batch[:, :-1])
                    loss = torch.nn.functional.cross_entropy(
                        logits.float().flatten(0, 1), batch[:, 1:].flatten())
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    losses[fsdp].append(loss.item())
            assert losses[True] == pytest.approx(losses[False], rel=2e-2)
            assert losses[True][-1] < losses[True][0]
    finally:
        if owned:
            dist.destroy_process_group()
