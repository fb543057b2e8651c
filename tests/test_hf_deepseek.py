"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) in and out of Hugging Face: ``python -m
dtrain.convert_hf import`` of a checkpoint laid out as DeepSeek's published ones (one tensor per
expert, the multi-token-prediction layers after the model's) computes transformers' logits, and
its export loads in transformers and computes them again; the MTP layers come back bit for bit,
their copies of the embedding and output layer checked on the way in and written on the way
out; a checkpoint transformers saved (no MTP layers) imports without MTP."""

import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel

from dtrain import Trainer, convert_hf, load_config
from dtrain.config import ConfigError
from dtrain.convert_hf import args_for_export
from dtrain.hf_checkpoint import load_model
from dtrain.hf_config import args_from_hf_config, hf_architecture_of, hf_config_from_args
from dtrain.model_shape import model_args_of
from dtrain.models import PRESETS
from dtrain.models.mtp import mtp_columns

# fp32 on the CPU: dtrain and transformers differ only in the order of sums and in RoPE's
# angles (fp64 in dtrain, fp32 in transformers), each ~1e-7 of the values.
TOLERANCE = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 0.8, "mscale_all_dim": 1.0}
BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, rms_norm_eps=1e-5,
            max_position_embeddings=64, attn_implementation="eager")
CASES = {
    # DeepSeek-V3's shape: queries through a latent, one dense block first, 2 groups of 2
    # experts (top 2 from the best group), routed scale 2.5, YaRN with mscale_all_dim; 1 depth.
    "v3": dict(q_lora_rank=24, first_k_dense_replace=1, n_group=2, topk_group=1,
               routed_scaling_factor=2.5, rope_parameters=YARN, num_nextn_predict_layers=1),
    # One query projection, every block MoE, no groups nor scale, no RoPE scaling, tied
    # embeddings; 2 depths.
    "plain": dict(q_lora_rank=None, first_k_dense_replace=0, n_group=1, topk_group=1,
                  routed_scaling_factor=1.0, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  num_nextn_predict_layers=2),
    # Attention biases, two dense blocks, and a checkpoint laid out for rotate_half: its rotary
    # rows are interleaved at import and written interleaved (rope_interleave true) at export.
    "halves": dict(q_lora_rank=24, first_k_dense_replace=2, n_group=2, topk_group=2,
                   routed_scaling_factor=2.5, attention_bias=True, rope_interleave=False,
                   rope_parameters=YARN, num_nextn_predict_layers=1),
}


def random_hf_model(config: DeepseekV3Config) -> DeepseekV3ForCausalLM:
    """Every parameter drawn, norms around 1 and the routers' e_score_correction_bias too, so
    that a misplaced tensor changes the logits."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(draw(name, param.shape))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(draw(name, buffer.shape))
    return model


def draw(name: str, shape: torch.Size) -> torch.Tensor:
    if "norm" in name:
        return 0.5 + torch.rand(shape)
    if "e_score_correction_bias" in name:
        return 0.1 * torch.randn(shape)
    return torch.randn(shape) * (1.0 if "embed_tokens" in name else 0.15)


def checkpoint_tensors(model: DeepseekV3ForCausalLM, depths: int) -> dict[str, torch.Tensor]:
    """The model's tensors as DeepSeek publishes them: one per expert and matrix, and ``depths``
    MTP layers after the model's (random, each with copies of the embedding and output layer)."""
    out = {}
    tied = model.config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        base = name.rpartition(".")[0]
        if name == "lm_head.weight" and tied:  # saved once, as the embedding
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = (
                    gate[e], up[e])
        elif name.endswith("mlp.experts.down_proj"):
            out.update({f"{base}.{e}.down_proj.weight": tensor[e] for e in range(len(tensor))})
        else:
            out[name] = tensor
    n, dim = model.config.num_hidden_layers, model.config.hidden_size
    last = f"model.layers.{n - 1}."
    output = out["model.embed_tokens.weight" if tied else "lm_head.weight"]
    for k in range(depths):
        layer = f"model.layers.{n + k}."
        out.update({layer + name[len(last):]: draw(name, tensor.shape)
                    for name, tensor in out.items() if name.startswith(last)})
        out.update({f"{layer}{norm}.weight": draw("norm", (dim,))
                    for norm in ("enorm", "hnorm", "shared_head.norm")})
        out[f"{layer}eh_proj.weight"] = draw("eh_proj", (dim, 2 * dim))
        out[f"{layer}embed_tokens.weight"] = out["model.embed_tokens.weight"]
        out[f"{layer}shared_head.head.weight"] = output
    return {name: tensor.clone().contiguous() for name, tensor in out.items()}


def write_hf(folder, model: DeepseekV3ForCausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """An HF folder: config.json with the MTP depths ``tensors`` holds, and model.safetensors."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(model.config.to_dict()))


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """One case imported (``convert_hf import``) and exported again (``convert_hf export``,
    fp32): a namespace of the transformers model, its checkpoint's tensors and the folders."""
    root = tmp_path_factory.mktemp(request.param)
    config = DeepseekV3Config(**BASE, **CASES[request.param])
    hf = random_hf_model(config)
    tensors = checkpoint_tensors(hf, config.num_nextn_predict_layers)
    write_hf(root / "hf", hf, tensors)
    assert convert_hf.main(["import", str(root / "hf"), str(root / "ckpt")]) == 0
    assert convert_hf.main(["export", str(root / "ckpt"), str(root / "out"), "--dtype",
                            "fp32"]) == 0
    return SimpleNamespace(hf=hf, tensors=tensors, root=root,
                           args=args_for_export(root / "ckpt", None))


def tokens(vocab: int, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))


def test_the_import_computes_transformers_logits(converted):
    ids = tokens(96)
    model = load_model(converted.root / "ckpt", converted.args).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids), converted.hf(ids).logits, rtol=TOLERANCE,
                              atol=TOLERANCE)


def test_the_export_loads_in_transformers_with_the_same_logits(converted):
    back = transformers.AutoModelForCausalLM.from_pretrained(converted.root / "out").eval()
    assert isinstance(back, DeepseekV3ForCausalLM)
    ids = tokens(96)
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, converted.hf(ids).logits, rtol=TOLERANCE,
                              atol=TOLERANCE)


def test_the_export_writes_the_checkpoint_tensors_back_bit_for_bit(converted):
    # Every tensor, the MTP layers and their copies included, in DeepSeek's layout; a checkpoint
    # laid out for rotate_half comes back with its rotary rows in DeepSeek's interleaved order
    # (rope_interleave true), which the logits tests check.
    written = load_file(str(converted.root / "out" / "model.safetensors"))
    assert written.keys() == converted.tensors.keys()
    config = json.loads((converted.root / "out" / "config.json").read_text())
    assert config["rope_interleave"] is True
    rotary = ("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
              "kv_a_proj_with_mqa.bias")
    for name, tensor in converted.tensors.items():
        if converted.hf.config.rope_interleave or not name.endswith(rotary):
            assert torch.equal(written[name], tensor), name


def test_reimporting_the_export_gives_the_same_weights_bit_for_bit(converted, tmp_path):
    assert convert_hf.main(["import", str(converted.root / "out"), str(tmp_path)]) == 0
    again = args_for_export(tmp_path, None)
    assert again == converted.args
    assert again.mtp_depths == converted.hf.config.num_nextn_predict_layers
    first = load_model(converted.root / "ckpt", converted.args).state_dict()
    second = load_model(tmp_path, again).state_dict()
    assert first.keys() == second.keys() and any(name.startswith("mtp.") for name in first)
    for name, tensor in first.items():
        assert torch.equal(second[name], tensor), name


def test_a_bf16_export_keeps_the_expert_bias_in_fp32(converted, tmp_path):
    # As DeepSeek's checkpoints and transformers keep it: rounded, it would change the routing.
    assert convert_hf.main(["export", str(converted.root / "ckpt"), str(tmp_path)]) == 0
    written = load_file(str(tmp_path / "model.safetensors"))
    bias = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert written[bias].dtype == torch.float32
    assert torch.equal(written[bias], converted.tensors[bias])
    assert written["model.layers.3.eh_proj.weight"].dtype == torch.bfloat16


def transformers_mtp(hf: DeepseekV3ForCausalLM, tensors: dict[str, torch.Tensor]) -> MtpModel:
    """transformers' MTP drafter of (a copy of) ``hf`` holding the checkpoint's MTP layers:
    layer ``num_hidden_layers + k`` is its ``layers.<k>`` (``eh_proj``, the norms,
    ``shared_head.norm`` as ``post_norm``, the block as ``mtp_block`` with its experts fused);
    the embedding and output layer the model's."""
    n, depths = hf.config.num_hidden_layers, hf.config.num_nextn_predict_layers
    mtp = MtpModel(copy.deepcopy(hf), depths).eval()
    tied = hf.config.tie_word_embeddings
    state = {"embed_tokens.weight": tensors["model.embed_tokens.weight"],
             "shared_head.weight": tensors["model.embed_tokens.weight" if tied
                                           else "lm_head.weight"]}
    for k in range(depths):
        layer, ours = f"model.layers.{n + k}.", f"layers.{k}."
        experts = hf.config.n_routed_experts
        for name, tensor in tensors.items():
            if not name.startswith(layer) or ".mlp.experts." in name:
                continue
            name = name[len(layer):]
            if name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
                state[ours + name] = tensor
            elif name == "shared_head.norm.weight":
                state[ours + "post_norm.weight"] = tensor
            elif name not in ("embed_tokens.weight", "shared_head.head.weight"):
                state[f"{ours}mtp_block.{name}"] = tensor
        block = f"{ours}mtp_block.mlp.experts."
        state[block + "gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{layer}mlp.experts.{e}.{proj}_proj.weight"] for proj in ("gate", "up")])
            for e in range(experts)])
        state[block + "down_proj"] = torch.stack(
            [tensors[f"{layer}mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
    mtp.load_state_dict(state)
    return mtp


def test_the_imported_mtp_depths_compute_transformers_mtp_logits(converted):
    # Depth k reads the model's normalised hidden state (or depth k - 1's) and the embeddings
    # of the tokens k places on; transformers' MtpModel computes the same from the same layers.
    hf, depths = converted.hf, converted.args.mtp_depths
    whole = tokens(96, 17)
    columns, _ = mtp_columns(whole[:, :-1], whole[:, 1:], depths)
    model = load_model(converted.root / "ckpt", converted.args).eval()
    mtp = transformers_mtp(hf, converted.tensors)
    positions = torch.arange(16)[None]
    with torch.no_grad():
        ours = model(columns).unflatten(0, (1 + depths, 2))
        hidden = hf.model(columns[..., 0]).last_hidden_state
        for k in range(depths):
            hidden = mtp.forward_layer(k, hidden, positions, None, input_ids=columns[..., k + 1])
            assert torch.allclose(ours[k + 1], mtp.shared_head(hidden), rtol=TOLERANCE,
                                  atol=TOLERANCE), k


def test_an_mtp_layer_whose_embedding_copy_differs_is_refused_in_one_line(tmp_path, capsys):
    config = DeepseekV3Config(**BASE, **CASES["v3"])
    hf = random_hf_model(config)
    tensors = checkpoint_tensors(hf, 1)
    tensors["model.layers.3.embed_tokens.weight"][5, 0] += 1.0
    write_hf(tmp_path / "hf", hf, tensors)
    assert convert_hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: the HF checkpoint's model.layers.3.embed_tokens.weight differs from "
        "model.embed_tokens.weight: dtrain's multi-token prediction shares the model's "
        "embedding and output layer; copy model.embed_tokens.weight into "
        "model.layers.3.embed_tokens.weight to import it"]


def test_a_checkpoint_transformers_saved_imports_without_mtp(tmp_path, capsys):
    # transformers writes num_nextn_predict_layers 1 and no MTP layer: the import, and the
    # recipe that trains from it, have none.
    hf = random_hf_model(DeepseekV3Config(**BASE, **CASES["v3"]))
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert "imported 3 layers, dim 32" in capsys.readouterr().out
    args = args_for_export(tmp_path / "ckpt", None)
    assert args.mtp_depths == 0
    recipe = load_config(tmp_path / "ckpt" / "recipe.toml")
    assert model_args_of(recipe.model).mtp_depths == 0
    ids = tokens(96)
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path / "ckpt", args).eval()(ids), hf(ids).logits,
                              rtol=TOLERANCE, atol=TOLERANCE)


# deepseek-ai/DeepSeek-V3's config.json, without its FP8 quantization_config.
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_the_published_config_is_the_preset_but_for_the_balance_loss_weight():
    # The preset takes the report's alpha 0.0001; the config.json says 0.001.
    preset = PRESETS["deepseek_v3_671b"]
    assert args_from_hf_config(PUBLISHED) == dataclasses.replace(preset, moe_aux_loss_coeff=0.001)


def test_the_exported_config_has_every_key_of_the_published_one():
    preset = PRESETS["deepseek_v3_671b"]
    config = hf_config_from_args(preset)
    assert hf_architecture_of(preset) == "DeepseekV3ForCausalLM"
    assert set(PUBLISHED) - {"bos_token_id", "eos_token_id"} <= set(config)
    assert args_from_hf_config(config) == preset
    assert config["rope_interleave"] is True
    assert config["rope_scaling"]["rope_type"] == "yarn"
    assert DeepseekV3Config(**config).num_nextn_predict_layers == 1


def test_one_query_projection_is_exported_as_a_null_q_lora_rank():
    args = dataclasses.replace(PRESETS["deepseek_v3_671b"], q_lora_rank=None, mtp_depths=0)
    config = hf_config_from_args(args)
    assert config["q_lora_rank"] is None and config["num_nextn_predict_layers"] == 0
    assert args_from_hf_config(json.loads(json.dumps(config))) == args


@pytest.mark.parametrize("change, message", [
    ({"moe_layers": (0, 2)}, r"^dense blocks \[1\] not all before the MoE ones"),
    ({"moe_router": "softmax"}, "multi-head latent attention with a softmax router"),
    ({"moe_shared_hidden": 24}, "a shared expert 24 wide, no multiple of the experts' 16"),
    ({"out_bias": True}, "biases on wq_a and wkv_a but not on wo, or the reverse"),
    ({"attention": "gqa"}, r"^multi-token prediction \(1 depths\) without multi-head latent "
                           "attention"),
])
def test_a_shape_deepseek_v3_does_not_have_is_refused_in_one_line(change, message):
    args = args_from_hf_config(DeepseekV3Config(**BASE, **CASES["v3"]).to_dict())
    with pytest.raises(ConfigError, match=message) as refused:
        hf_architecture_of(dataclasses.replace(args, **change))
    assert "\n" not in str(refused.value)


def test_a_run_trained_from_an_import_exports_its_weights(tmp_path, capsys):
    # The import's recipe trains two steps (MTP included) and saves; the run folder exports as
    # any run's does, and transformers computes the trained model's logits.
    config = DeepseekV3Config(**{**BASE, "vocab_size": 4096}, **CASES["v3"])
    hf = random_hf_model(config)
    imported = checkpoint_tensors(hf, 1)
    write_hf(tmp_path / "hf", hf, imported)
    assert convert_hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert "imported 3 layers and 1 MTP depths" in capsys.readouterr().out
    cfg = load_config(tmp_path / "ckpt" / "recipe.toml", {
        "training.steps": 2, "training.seq_len": 32, "training.global_batch_size": 2,
        "training.micro_batch_size": 1, "metrics.tensorboard": False,
        "checkpoint.enabled": True, "checkpoint.interval": 2,
        "job.output_dir": str(tmp_path / "runs")})
    trainer = Trainer(cfg)
    trainer.train()
    run = tmp_path / "runs" / cfg.job.name
    assert convert_hf.main(["export", str(run), str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokens(4096)
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, trainer.model(ids), rtol=TOLERANCE,
                              atol=TOLERANCE)
    # The MTP depth trained too, and the export holds its trained weights.
    proj = "model.layers.3.eh_proj.weight"
    written = load_file(str(tmp_path / "out" / "model.safetensors"))[proj]
    assert torch.equal(written, trainer.model.mtp["0"].proj.weight.detach())
    assert not torch.equal(written, imported[proj])
