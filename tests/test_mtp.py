"""Multi-token prediction (DeepSeek-V3): the loss against a reference written from the report's
equations, the training run's log, and tiny DeepSeek-V3 (latent attention, grouped sigmoid
routing, a shared expert, a dense first block, one MTP depth) and Qwen3-MoE shapes trained under
FSDP 2, EP 2, PP 2 (1F1B; interleaved with activation checkpointing; the depth on the last
stage), CP 2, TP 2 x EP 2, EP 4 and PP 2 x FSDP 2 x EP 2, equal to one process (fp32, 1e-5:
losses, gradient norms, the MTP and aux losses)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import REL, assert_same_run, run_distributed

from dtrain import Trainer, load_config
from dtrain.models.llama import LlamaArgs, Transformer
from dtrain.models.mtp import IGNORE, mtp_columns
from dtrain.mtp import MTPLoss
from dtrain.step import cross_entropy_sum

# DeepSeek-V3 in small: a compressed query, 4 sigmoid-routed experts in 2 groups with a routed
# scale and a shared expert, the first of 4 blocks dense, one MTP depth at weight 0.3.
DEEPSEEK = {"model.n_layers": 4, "model.attention": "mla", "model.q_lora_rank": 32,
            "model.kv_lora_rank": 24, "model.qk_nope_head_dim": 16, "model.qk_rope_head_dim": 8,
            "model.v_head_dim": 16, "model.n_experts": 4, "model.moe_top_k": 2,
            "model.moe_hidden_size": 64, "model.moe_shared_hidden": 64,
            "model.moe_router": "sigmoid", "model.moe_n_group": 2, "model.moe_topk_group": 1,
            "model.moe_routed_scale": 2.5, "model.moe_first_dense_layers": 1,
            "model.moe_aux_loss_coeff": 0.01, "model.mtp_depths": 1, "model.mtp_loss_weight": 0.3}
# Qwen3-MoE in small: per-head q/k norms, a head width apart from hidden / heads, 4 softmax
# experts, top 2 renormalised, every block MoE.
QWEN3_MOE = {"model.n_layers": 4, "model.head_dim": 16, "model.qk_norm": True,
             "model.n_experts": 4, "model.moe_top_k": 2, "model.moe_hidden_size": 64,
             "model.moe_router": "softmax", "model.moe_aux_loss_coeff": 0.01}
RUN = {"training.seq_len": 32, "training.global_batch_size": 4, "training.micro_batch_size": 1,
       "training.steps": 4, "lr_schedule.warmup_steps": 2, "metrics.log_every": 1,
       "metrics.tensorboard": False}
SHAPES = {"deepseek": DEEPSEEK, "qwen3_moe": QWEN3_MOE}


def tiny_args(depths: int) -> LlamaArgs:
    return LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=96, max_seq_len=32,
                     attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                     qk_rope_head_dim=8, v_head_dim=8, n_experts=4, moe_top_k=2,
                     moe_hidden_size=32, moe_shared_hidden=32, moe_router="sigmoid",
                     moe_layers=(1,), mtp_depths=depths, mtp_loss_weight=0.3)


def test_columns_hold_each_depths_tokens_and_targets():
    sequence = torch.arange(10, 19).unsqueeze(0)  # t_1 .. t_9
    tokens, targets = mtp_columns(sequence[:, :-1], sequence[:, 1:], depths=2)
    assert tokens[0, :, 0].tolist() == list(range(10, 18))
    assert tokens[0, :, 1].tolist() == list(range(11, 19))
    assert tokens[0, :, 2].tolist() == [*range(12, 19), 0]
    assert targets[0, :, 1].tolist() == [*range(12, 19), IGNORE]
    assert targets[0, :, 2].tolist() == [*range(13, 19), IGNORE, IGNORE]


def report_objective(model: Transformer, sequence: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The DeepSeek-V3 report's eq. 21-25, with the embedding-first concatenation of its released
    weights: h^0 the model's representation (after its final norm) of t_1..t_T; for depth k,
    h'_i = proj_k([enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)]) for i = 1..T-k only,
    h^k_{1:T-k} = norm_k(TRM_k(h'_{1:T-k})) on that shorter sequence, and
    L_k = -1/T sum_i log P^k_i[t_{i+k+1}]. Returns L_main + weight / D sum_k L_k and the L_k."""
    args, batch, total = model.args, sequence.shape[0], sequence.shape[1] - 1
    inputs = sequence[:, :-1]
    h = model.tok_embeddings(inputs)
    for block in model.layers.values():
        h = block(h, model.rope[:total])
    h = model.norm(h)
    count = batch * total
    main = F.cross_entropy(model.output(h).flatten(0, 1), sequence[:, 1:].flatten(),
                           reduction="sum") / count
    depth_losses = []
    for k, depth in enumerate(model.mtp.values(), start=1):
        n = total - k
        embedded = model.tok_embeddings(sequence[:, k:k + n])
        x = depth.proj(torch.cat([depth.enorm(embedded), depth.hnorm(h[:, :n])], dim=-1))
        h = depth.norm(depth.block(x, model.rope[:n]))
        targets = sequence[:, k + 1:k + 1 + n]
        depth_losses.append(F.cross_entropy(model.output(h).flatten(0, 1), targets.flatten(),
                                            reduction="sum") / count)
    return main + args.mtp_loss_weight / args.mtp_depths * sum(depth_losses), depth_losses


@pytest.mark.parametrize("depths", [1, 2])
def test_loss_and_gradient_match_the_report_equations(depths):
    torch.manual_seed(0)
    model = Transformer(tiny_args(depths))
    model.init_weights(seed=3)
    sequence = torch.randint(0, 96, (2, 17))
    inputs, labels = sequence[:, :-1], sequence[:, 1:]
    count = labels.numel()

    expected, expected_depths = report_objective(model, sequence)
    expected.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    loss_fn = MTPLoss(cross_entropy_sum, depths, 0.3, tokens=count, groups=[],
                      device=torch.device("cpu"))
    tokens, targets = mtp_columns(inputs, labels, depths)
    logits = model(tokens)
    assert logits.shape == (2 * (1 + depths), 16, 96)
    loss = loss_fn(logits, targets)
    # The value is the next-token loss alone; the depths reach only the gradient and the log.
    main = F.cross_entropy(logits[:2].flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(loss, main)
    (loss / count).backward()
    assert loss_fn.depth_losses() == pytest.approx([x.item() for x in expected_depths], rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert model.mtp["0"].proj.weight.grad.abs().sum() > 0


def test_the_model_alone_gives_next_token_logits_and_the_plain_loss():
    model = Transformer(tiny_args(1))
    model.init_weights(seed=0)
    inputs = torch.randint(0, 96, (2, 16))
    loss_fn = MTPLoss(cross_entropy_sum, 1, 0.3, tokens=32, groups=[], device=torch.device("cpu"))
    logits = model(inputs)
    assert logits.shape == (2, 16, 96)
    torch.testing.assert_close(loss_fn(logits, inputs), cross_entropy_sum(logits, inputs))
    assert loss_fn.sums is None  # nothing recorded for an evaluation batch


def test_a_deepseek_run_logs_the_mtp_loss_and_rebuilds_from_its_config(tmp_path):
    trainer = Trainer(load_config("debug", {**DEEPSEEK, **RUN, "job.output_dir": str(tmp_path)}))
    history = trainer.train()
    assert trainer.model.mtp is not None and len(trainer.model.mtp) == 1
    assert isinstance(trainer.model.mtp["0"].block.feed_forward, type(
        trainer.model.layers["3"].feed_forward))  # the last block's kind: MoE
    for record in history:
        # Depth 1 predicts the token after next: harder than the next, of the same order.
        assert 0.5 * record["loss"] < record["mtp_loss"] < 1.5 * record["loss"]
    assert history[-1]["mtp_loss"] < history[0]["mtp_loss"]
    again = load_config(str(tmp_path / "debug" / "config.toml"))
    assert (again.model.mtp_depths, again.model.mtp_loss_weight) == (1, 0.3)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp_refs")
    return {name: Trainer(load_config("debug", {**shape, **RUN, "job.name": name,
                                                "job.output_dir": str(out)})).train()
            for name, shape in SHAPES.items()}


def assert_same_moe_run(run: dict, reference: list[dict], label: str) -> None:
    assert_same_run(run, reference, label)
    for ref, got in zip(reference, run["history"], strict=True):
        for key in ("aux_loss", "mtp_loss"):
            if key in ref:
                assert got[key] == pytest.approx(ref[key], rel=REL), (label, key, ref["step"])


TWO_RANKS = [
    {"parallel.dp_shard": 2},
    {"parallel.ep": 2},
    {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "1F1B"},
    {"parallel.pp": 2, "parallel.dp_shard": 1, "parallel.pp_schedule": "Interleaved1F1B",
     "parallel.pp_virtual_stages": 2, "activation_checkpoint.mode": "full"},
    {"parallel.cp": 2, "parallel.dp_shard": 1},
]
FOUR_RANKS = [
    {"parallel.tp": 2, "parallel.ep": 2, "parallel.dp_shard": 2},
    {"parallel.ep": 4},
    {"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.ep": 2,
     "parallel.pp_schedule": "Interleaved1F1B", "parallel.pp_virtual_stages": 2},
]


@pytest.mark.parametrize("nproc, layouts", [(2, TWO_RANKS), (4, FOUR_RANKS)],
                         ids=["two-ranks", "four-ranks"])
def test_deepseek_and_qwen3_moe_layouts_match_one_process(tmp_path, references, nproc, layouts):
    specs = [{**shape, **RUN, **layout, "job.name": f"{name}{i}", "job.output_dir": str(tmp_path)}
             for name, shape in SHAPES.items() for i, layout in enumerate(layouts)]
    runs = iter(run_distributed(tmp_path, nproc, specs))
    for name in SHAPES:
        for layout in layouts:
            assert_same_moe_run(next(runs), references[name], f"{name} {layout}")


def test_a_deepseek_checkpoint_of_a_pipeline_resumes_under_expert_parallel(tmp_path, references):
    # The MTP depth is saved from the last stage and loaded whole on every rank; the expert
    # bias (a buffer) comes along.
    common = {**DEEPSEEK, **RUN, "checkpoint.enabled": True, "checkpoint.interval": 2,
              "job.output_dir": str(tmp_path), "job.name": "run"}
    run_distributed(tmp_path / "a", 2, [{**common, "parallel.pp": 2, "parallel.dp_shard": 1,
                                         "_until": 2}])
    (run,) = run_distributed(tmp_path / "b", 2, [{**common, "parallel.ep": 2}])
    assert [r["step"] for r in run["history"]] == [3, 4]
    for ref, got in zip(references["deepseek"][2:], run["history"], strict=True):
        for key in ("loss", "mtp_loss", "aux_loss"):
            assert got[key] == pytest.approx(ref[key], rel=REL), key
