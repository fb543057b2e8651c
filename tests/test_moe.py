"""The MoE layer on one device: routing, the auxiliary losses against hand-computed values,
capacity-factor dropping, grouped GEMM against the loop, and the Mixtral presets' sizes."""

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtrain import load_config
from dtrain.kernels.accumulate import host_ends
from dtrain.metrics import model_flops_per_token
from dtrain.model_shape import moe_overrides
from dtrain.models import build
from dtrain.models.moe import (
    MoE,
    Router,
    grouped_swiglu,
    load_balancing_loss,
    looped_swiglu,
    router_z_loss,
)


def moe(**kwargs) -> MoE:
    torch.manual_seed(0)
    layer = MoE(dim=16, hidden=24, n_experts=4, top_k=2, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer.reset_stats()
    return layer


def per_token_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its chosen experts one at a time, weighted: the definition."""
    _, _, chosen, weights = layer.router(x)
    e = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            i = chosen[t, j]
            h = torch.nn.functional.silu(e.w1[i] @ x[t]) * (e.w3[i] @ x[t])
            out[t] += weights[t, j] * (e.w2[i] @ h)
    return out


def test_softmax_router_takes_the_top_k_and_renormalises():
    router = Router(dim=8, n_experts=4, top_k=2)
    x = torch.randn(5, 8)
    logits, scores, chosen, weights = router(x)
    assert torch.equal(chosen, logits.topk(2).indices)
    assert torch.allclose(scores.sum(-1), torch.ones(5))
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    assert torch.allclose(weights, scores.gather(1, chosen) / scores.gather(1, chosen).sum(-1,
                                                                                          True))


def test_sigmoid_router_bias_steers_the_choice_but_not_the_weights():
    router = Router(dim=8, n_experts=4, top_k=1, score="sigmoid")
    x = torch.randn(6, 8)
    router.expert_bias[:] = torch.tensor([0.0, 0.0, 10.0, 0.0])  # every token picks expert 2
    _, scores, chosen, weights = router(x)
    assert torch.equal(chosen.flatten(), torch.full((6,), 2))
    assert torch.allclose(weights, torch.ones(6, 1))  # one score, normalised
    assert torch.all((scores > 0) & (scores < 1))


def test_moe_layer_equals_routing_each_token_by_hand():
    layer = moe()
    x = torch.randn(2, 5, 16)
    got = layer(x)
    assert torch.allclose(got.view(-1, 16), per_token_reference(layer, x.view(-1, 16)),
                          atol=1e-5)


def test_load_balancing_and_z_loss_hand_computed():
    # 4 tokens, 2 experts, top-1: tokens choose 0, 0, 0, 1, so f = (3/4, 1/4); the mean scores
    # are P = (0.65, 0.35); aux = E * sum f P = 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15.
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.6, 0.4], [0.3, 0.7]])
    counts = torch.tensor([3, 1])
    assert load_balancing_loss(scores, counts, top_k=1).item() == pytest.approx(1.15)
    # Perfect balance gives 1.
    uniform = torch.full((4, 2), 0.5)
    assert load_balancing_loss(uniform, torch.tensor([4, 4]), top_k=2).item() == pytest.approx(1)
    # z-loss: logsumexp of two zero logits is ln 2.
    assert router_z_loss(torch.zeros(3, 2)).item() == pytest.approx(math.log(2) ** 2)


def test_aux_losses_reach_the_router_gradient_with_their_coefficients():
    x = torch.randn(12, 16)
    plain, with_aux = moe(), moe(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    with_aux.aux_grad_scale = 0.5
    plain(x).sum().backward()
    with_aux(x).sum().backward()
    # The same output: the aux losses only add gradient.
    assert torch.equal(plain(x), with_aux(x))
    router = moe().router
    logits, scores, chosen, _ = router(x)
    counts = torch.bincount(chosen.flatten(), minlength=4)
    aux = 0.1 * load_balancing_loss(scores, counts, 2) + 0.01 * router_z_loss(logits)
    (0.5 * aux).backward()
    expected = plain.router.gate.weight.grad + router.gate.weight.grad
    assert torch.allclose(with_aux.router.gate.weight.grad, expected, atol=1e-6)
    stats = with_aux.stats()
    assert stats[:4].sum().item() == 2 * 12 * 2  # two forwards of 12 tokens x top 2
    assert stats[-1].item() == 2


def test_capacity_factor_drops_assignments_past_capacity():
    layer = moe(capacity_factor=0.5)  # capacity ceil(0.5 * 8 tokens * 2 / 4) = 2 per expert
    with torch.no_grad():  # every token's choices: experts 0 and 1, in that order of score
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0, 0], layer.router.gate.weight[1, 0] = 2.0, 1.0
    x = torch.randn(8, 16).abs() + 0.1
    assert layer.capacity(8) == 2
    got = layer(x)
    full = per_token_reference(layer, x)
    assert torch.allclose(got[:2], full[:2], atol=1e-5)  # the first two tokens fit
    assert torch.equal(got[2:], torch.zeros_like(got[2:]))  # the rest are dropped
    dropless = moe()
    dropless.load_state_dict(layer.state_dict())
    assert torch.allclose(dropless(x), full, atol=1e-5)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 10, 0]], ids=["uneven", "one_expert"])
def test_grouped_gemm_equals_the_loop(counts):
    # torch._grouped_mm has a CPU kernel in torch >= 2.13 (fp32); rows need 16-byte strides.
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w1, w3 = torch.randn(4, 24, 16), torch.randn(4, 24, 16)
    w2 = torch.randn(4, 16, 24, requires_grad=True)
    counts = torch.tensor(counts)
    grouped = grouped_swiglu(x, counts, w1, w2, w3)
    looped = looped_swiglu(x, counts, w1, w2, w3)
    assert torch.allclose(grouped, looped, rtol=1e-5, atol=1e-4)
    upstream = torch.randn(10, 16)
    gx, gw = torch.autograd.grad(grouped, (x, w2), upstream)
    lx, lw = torch.autograd.grad(looped, (x, w2), upstream)
    assert torch.allclose(gx, lx, rtol=1e-5, atol=1e-4)
    assert torch.allclose(gw, lw, rtol=1e-5, atol=1e-4)


def test_mixtral_presets_have_the_published_sizes():
    for name, total, active in (("mixtral_8x7b", 46.7, 12.9), ("mixtral_8x22b", 141, 39)):
        model = build(name, device="meta")
        assert model.num_params() / 1e9 == pytest.approx(total, rel=0.005), name
        assert model.num_params(active=True) / 1e9 == pytest.approx(active, rel=0.005), name


def test_flops_count_active_parameters():
    model = build("mixtral_8x7b", device="meta", n_layers=4)
    args = model.args
    expected = 6 * model.num_params(exclude_embedding=True, active=True) + 12 * 4 * 32 * 128 * 512
    assert model_flops_per_token(model, 512) == expected
    assert expected < 6 * model.num_params(exclude_embedding=True)
    assert args.expert_dim == 14336 and args.n_layers == 4


def test_moe_config_keeps_or_replaces_the_presets_coefficients():
    kept = moe_overrides(load_config("debug", {"model.name": "mixtral_debug"}).model)
    assert "moe_aux_loss_coeff" not in kept and "moe_router" not in kept
    off = moe_overrides(load_config("debug", {"model.moe_aux_loss_coeff": 0.0,
                                              "model.moe_router": "sigmoid"}).model)
    assert off["moe_aux_loss_coeff"] == 0.0 and off["moe_router"] == "sigmoid"


def test_expert_bias_moves_towards_balance():
    layer = MoE(dim=8, hidden=8, n_experts=4, top_k=1, score="sigmoid")
    layer.router.expert_bias.zero_()
    layer.update_expert_bias(torch.tensor([10.0, 2.0, 2.0, 2.0]), rate=0.01)
    assert torch.allclose(layer.router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_expert_parallel_weights_trace_under_compile():
    # Expert parallel makes the experts' weights DTensors; the experts compute on the local
    # shard, read in a way torch.compile traces (it once took the DTensor itself and failed).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        experts = moe().experts
        plain = [p.detach().clone() for p in (experts.w1, experts.w2, experts.w3)]
        for name, param in list(experts.named_parameters()):
            experts.register_parameter(
                name, torch.nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        x, counts = torch.randn(10, 16), torch.tensor([3, 2, 4, 1])
        torch._dynamo.reset()
        out = torch.compile(experts, backend="eager")(x, counts)
        torch.testing.assert_close(out, looped_swiglu(x, counts, *plain))
    finally:
        dist.destroy_process_group()


def autograd_nodes(out: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``out`` was computed through."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [f for f, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


def test_experts_under_autocast_take_stacked_weights_with_the_per_expert_gradients():
    # fp32 weights under bf16 autocast (one device, no FSDP): the routed tokens and each stacked
    # weight are cast whole, so the grouped GEMM runs (it once fell back to the per-expert loop,
    # whose autocast casts each w[e] and sums the gradients through a select per expert). The
    # result and the gradients are those of the per-expert casts.
    x = torch.randn(10, 16)
    results = {}
    for path in ("per_expert_casts", "grouped", "loop"):
        layer = moe(aux_loss_coeff=0.01)
        e = layer.experts
        if path == "per_expert_casts":  # autocast casting each expert's slice, as before
            e.forward = lambda rows, counts, e=e: looped_swiglu(rows, counts, e.w1, e.w2, e.w3)
        else:
            e.gemm = path
        rows = []
        e.register_forward_pre_hook(lambda module, args, rows=rows: rows.append(args[0].dtype))
        xin = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(xin)
        # bf16 rows: what grouped_mm_available needs to pick the grouped GEMM on CUDA
        assert rows == [torch.bfloat16]
        nodes = autograd_nodes(out)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        results[path] = (out, xin.grad, e.w1.grad, e.w2.grad, e.w3.grad)
        assert out.dtype == torch.float32 and e.w1.grad.dtype == torch.float32
        if path == "grouped":
            assert "SelectBackward0" not in nodes
    for path in ("grouped", "loop"):
        for got, want in zip(results[path], results["per_expert_casts"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    for got, want in zip(results["loop"], results["per_expert_casts"], strict=True):
        assert torch.equal(got, want)  # the same bf16 products: casts commute with selects


def host_syncs(layer: MoE, x: torch.Tensor) -> list[str]:
    """The device-to-host reads in the forward and backward graphs of ``layer`` on ``x`` under
    bf16 autocast, traced whole by torch.compile (AOT autograd, without Inductor)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    found = []

    def capture(gm, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes
                     if n.op == "call_function" and "_local_scalar_dense" in str(n.target))
        return make_boxed_func(gm)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True,
                             backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    out.backward(torch.ones_like(out))
    return found


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_grouped_moe_layer_reads_nothing_on_the_host(capacity_factor):
    # The router, permutation, aux loss and grouped GEMMs stay on the device; the loop, which
    # reads the expert counts, is the control that shows the reads are seen.
    x = torch.randn(12, 16, requires_grad=True)
    grouped = moe(aux_loss_coeff=0.01, capacity_factor=capacity_factor, gemm="grouped")
    looped = moe(aux_loss_coeff=0.01, capacity_factor=capacity_factor, gemm="loop")
    assert host_syncs(grouped, x) == []
    assert len(host_syncs(looped, x)) >= 1


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (the groups' ends copied to pinned memory); its output is "
                           "in docs/benchmarks.md")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_the_gpu_the_weight_gradients_read_the_ends_without_waiting_for_the_device(compiled):
    # Experts large enough for one accumulating GEMM each (LOOPED_VALUES), whose loop reads the
    # groups' ends on the host: from the copy the forward started, so no synchronising read
    # (which the sync check turns into an error: the control shows it does).
    torch.manual_seed(0)
    n_experts, dim, hidden = 4, 1024, 8192
    weights = [torch.randn(n_experts, *shape, device="cuda") / 32
               for shape in ((hidden, dim), (dim, hidden), (hidden, dim))]
    grads = [torch.zeros_like(w) for w in weights]
    operands = [((w.bfloat16(),), g) for w, g in zip(weights, grads, strict=True)]
    counts = torch.tensor([300, 0, 1000, 748], device="cuda")
    swiglu = torch.compile(grouped_swiglu) if compiled else grouped_swiglu

    def forward_backward():
        x = torch.randn(2048, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        swiglu(x, counts, *weights, "plain", operands).float().square().sum().backward()

    forward_backward()  # compilation and the one-time checks read the device
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            host_ends(torch.tensor([1, 2], dtype=torch.int32, device="cuda"))
        forward_backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g in grads:  # the empty expert got nothing, the others their products
        assert g[1].count_nonzero() == 0 and all(g[e].abs().sum() > 0 for e in (0, 2, 3))
