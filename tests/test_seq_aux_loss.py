"""DeepSeek-V3's complementary sequence-wise load-balancing loss (``moe_aux_loss_type =
"seq_aux_loss"``): its value and the gradient it sends the router gate are the report's
equations 17-20 computed one sequence at a time, it tells apart batches the micro-batch loss
does not, tensor parallel with sequence parallel reproduces one process, and a recipe trains
with it."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from conftest import logits_and_grads, on_two_gloo_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from dtrain import Trainer, load_config
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.models.moe import MoE
from dtrain.parallel.expert import split_moe_losses
from dtrain.parallel.tensor import apply_tp

COEFF = 0.1


def report_loss(logits: torch.Tensor, score: str, top_k: int) -> torch.Tensor:
    """DeepSeek-V3 report eq. 17-20 over logits (sequences, T, N_r), one sequence at a time:
    f_i = N_r / (K_r T) * #{t: s_it among the K_r highest of s_t}, s'_it = s_it / sum_j s_jt,
    P_i = mean_t s'_it, the loss sum_i f_i P_i; the mean over the sequences (Megatron's)."""
    losses = []
    for sequence in logits:
        tokens, n_experts = sequence.shape
        s = sequence.softmax(-1) if score == "softmax" else sequence.sigmoid()
        chosen = torch.zeros(n_experts)
        for t in range(tokens):
            for i in s[t].topk(top_k).indices.tolist():
                chosen[i] += 1
        f = n_experts / (top_k * tokens) * chosen
        p = (s / s.sum(-1, keepdim=True)).mean(0)
        losses.append((f * p).sum())
    return torch.stack(losses).mean()


def moe_of(score: str = "softmax", aux_loss_type: str = "seq_aux_loss", dim: int = 16,
           n_experts: int = 8, top_k: int = 2, **router) -> MoE:
    torch.manual_seed(0)
    moe = MoE(dim, 32, n_experts, top_k, score, aux_loss_coeff=COEFF, gemm="loop",
              aux_loss_type=aux_loss_type, **router)
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        nn.init.normal_(w, std=0.1)
    return moe


def aux_value(moe: MoE, x: torch.Tensor) -> float:
    """The aux-loss statistic of one training forward of ``moe`` on ``x``."""
    moe.reset_stats()
    moe(x)
    return moe.stats()[-3].item()


@pytest.mark.parametrize("score, router", [
    ("softmax", {}), ("sigmoid", {}), ("sigmoid", {"n_group": 4, "topk_group": 2})],
    ids=["softmax", "sigmoid", "sigmoid-groups-and-bias"])
def test_the_loss_and_the_gate_gradient_are_the_report_s_equations(score, router):
    moe = moe_of(score, **router)
    if score == "sigmoid":  # the bias steers the choice, never the loss's top k
        moe.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(3, 10, 16)
    out = moe(x)
    (out * 0).sum().backward()  # the gate's gradient is then the aux loss's alone
    gate = moe.router.gate.weight
    weight = gate.detach().clone().requires_grad_()
    want = report_loss(x @ weight.t(), score, 2)
    (want_grad,) = torch.autograd.grad(COEFF * want, weight)
    # fp32, the same sums in another order: 1e-6 of the value, 1e-5 of the largest gradient.
    assert moe.stats()[-3].item() == pytest.approx(want.item(), rel=1e-6)
    assert gate.grad.abs().max() > 1e-4
    assert (gate.grad - want_grad).abs().max() <= 1e-5 * want_grad.abs().max()
    if router:  # the case covers tokens whose biased, group-limited choice is not the top k
        _, scores, chosen, _ = moe.router(x.view(-1, 16))
        plain = scores.topk(2, dim=-1).indices
        assert (chosen.sort(-1).values != plain.sort(-1).values).any(-1).sum() >= 3


def directions(*rows: list[int]) -> torch.Tensor:
    """Sequences of 4-channel tokens, token t of a sequence pointing along its channel, with a
    little noise (no ties in the top k)."""
    x = torch.eye(4)[torch.tensor(rows)] * 4.0
    return x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))


def test_it_differs_from_the_micro_batch_loss_where_sequences_are_imbalanced_differently():
    # 4 experts, top 1, the gate the identity: a token takes the expert of its channel. The
    # first sequence uses experts 0 and 1 only, the second 2 and 3: balanced over the batch
    # (aux_loss near 1, its minimum), lopsided in each sequence (seq_aux_loss near 2). With
    # every sequence holding the same tokens, each sequence is the batch: the two agree.
    losses = {}
    for kind in ("aux_loss", "seq_aux_loss"):
        moe = moe_of(aux_loss_type=kind, dim=4, n_experts=4, top_k=1)
        with torch.no_grad():
            moe.router.gate.weight.copy_(torch.eye(4))
        losses[kind] = [aux_value(moe, directions([0, 1, 0, 1, 0, 1], [2, 3, 2, 3, 2, 3])),
                        aux_value(moe, directions([0, 1, 2, 3, 0, 1, 2, 3],
                                                  [3, 2, 1, 0, 3, 2, 1, 0]))]
    (aux_split, aux_mixed), (seq_split, seq_mixed) = losses["aux_loss"], losses["seq_aux_loss"]
    assert aux_split == pytest.approx(1.0, abs=0.05) and seq_split > 1.7
    assert seq_mixed == pytest.approx(aux_mixed, rel=1e-6)


def test_a_2d_input_is_one_sequence():
    moe = moe_of()
    x = torch.randn(12, 16)
    assert aux_value(moe, x) == pytest.approx(aux_value(moe, x.unsqueeze(0)), rel=1e-6)


# Tensor parallel 2 with sequence parallel: each rank routes half of each sequence's tokens.
TP_ARGS = LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                    max_seq_len=32, rope_theta=10000.0, n_experts=8, moe_top_k=2,
                    moe_hidden_size=32, moe_router="sigmoid", moe_n_group=2, moe_topk_group=1,
                    moe_aux_loss_coeff=0.5, moe_aux_loss_type="seq_aux_loss")


def tp_model() -> Transformer:
    model = Transformer(TP_ARGS)
    model.init_weights(seed=0)
    return model


def moe_layers(model: Transformer) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def tp_worker(rank: int, out: str) -> None:
    model, mesh = tp_model(), init_device_mesh("cpu", (2,))
    apply_tp(model, mesh, loss_parallel=False)
    split_moe_losses(model, mesh.get_group(), cp=1)  # as dtrain.parallel does under tp
    _, grads = logits_and_grads(model)
    # The MoE's weights are whole on each rank and see its tokens: their gradients and the
    # statistics (a shard's share of the forward's) add up over the ranks.
    gates = [m.router.gate.weight.grad for m in moe_layers(model)]
    stats = [m.stats() for m in moe_layers(model)]
    for t in (*gates, *stats):
        dist.all_reduce(t)
    if rank == 0:
        torch.save({"gates": gates, "stats": stats}, out)


def test_tensor_parallel_with_sequence_parallel_matches_one_process(tmp_path):
    # Per-sequence counts summed over the two halves of each sequence: the loss and the gate
    # gradients of one process at 1e-5 (fp32, sums in another order). A large coefficient, so
    # that counts left per rank would move the gradients far past that.
    out = tmp_path / "tp.pt"
    on_two_gloo_ranks(tp_worker, str(out))
    got = torch.load(out)
    model = tp_model()
    logits_and_grads(model)
    layers = moe_layers(model)
    assert len(layers) == len(got["gates"]) == 2
    for moe, gate, stats in zip(layers, got["gates"], got["stats"], strict=True):
        want = moe.stats()
        assert stats[-3].item() == pytest.approx(want[-3].item(), rel=1e-5)  # the aux loss
        assert torch.equal(stats[:-3], want[:-3])  # tokens per expert
        want_grad = moe.router.gate.weight.grad
        assert (gate - want_grad).abs().max() <= 1e-5 * want_grad.abs().max()


def test_a_recipe_with_seq_aux_loss_trains_a_deepseek_like_shape(tmp_path):
    shape = {"n_layers": 2, "attention": "mla", "q_lora_rank": 32, "kv_lora_rank": 24,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_experts": 4,
             "moe_top_k": 2, "moe_hidden_size": 64, "moe_shared_hidden": 64,
             "moe_router": "sigmoid", "moe_n_group": 2, "moe_topk_group": 1,
             "moe_first_dense_layers": 1, "moe_aux_loss_coeff": 0.01,
             "moe_aux_loss_type": "seq_aux_loss"}
    keys = "\n".join(f"{key} = {json.dumps(value)}" for key, value in shape.items())
    recipe = tmp_path / "deepseek_seq_aux.toml"
    recipe.write_text(f'[model]\nname = "llama3_debug"\n{keys}\n'
                      "[training]\nsteps = 3\nseq_len = 32\nglobal_batch_size = 4\n"
                      "micro_batch_size = 2\n[metrics]\nlog_every = 1\ntensorboard = false\n")
    trainer = Trainer(load_config(recipe, {"job.output_dir": str(tmp_path / "out")}))
    (moe,) = moe_layers(trainer.model)
    assert moe.aux_loss_type == "seq_aux_loss" and moe.aux_loss_coeff == 0.01
    records = trainer.train()
    assert [r["step"] for r in records] == [1, 2, 3]
    # 1 is the balanced minimum; each sequence of 32 tokens over 4 experts is never exactly so.
    assert all(1.0 < r["aux_loss"] < 4.0 and 0 < r["loss"] < 10 for r in records)
    saved = load_config(trainer.run_dir / "config.toml")
    assert saved.model.moe_aux_loss_type == "seq_aux_loss"


def test_the_args_refuse_an_unknown_loss_type():
    with pytest.raises(ValueError, match="moe_aux_loss_type 'global': use aux_loss or"):
        dataclasses.replace(TP_ARGS, moe_aux_loss_type="global")
