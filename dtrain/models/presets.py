"""Published model shapes. ``PRESETS[name]`` is the ``LlamaArgs`` of that model."""

from dtrain.models.llama import LlamaArgs, RopeScaling

LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_seq_len=8192)
LLAMA32_SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_seq_len=8192)
# DeepSeek's YaRN: 40 times a 4,096-token context; mscale and mscale_all_dim equal leave cos and
# sin unscaled and put mscale(40)^2 on the softmax scale (dtrain.models.mla.softmax_scale).
DEEPSEEK_V3_YARN = RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=4096,
                               beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK_V2_LITE_YARN = RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=4096,
                                    beta_fast=32.0, beta_slow=1.0, mscale=0.7, mscale_all_dim=0.7)

PRESETS: dict[str, LlamaArgs] = {
    # Tiny, for CPU tests and the debug recipe (vocabulary of the shipped debug tokenizer).
    "llama3_debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096,
                              multiple_of=64, rope_theta=500000.0, max_seq_len=2048),
    # Llama 3.2 1B / 3B: tied embeddings, RoPE scaled by 32.
    "llama3_1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000.0,
                           rope_scaling=LLAMA32_SCALING, max_seq_len=131072,
                           tie_embeddings=True),
    "llama3_3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                           multiple_of=256, ffn_dim_multiplier=1.0, rope_theta=500000.0,
                           rope_scaling=LLAMA32_SCALING, max_seq_len=131072,
                           tie_embeddings=True),
    # Llama 3.1 8B / 70B / 405B.
    "llama3_8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                           multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                           rope_scaling=LLAMA31_SCALING, max_seq_len=131072),
    "llama3_70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                            multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                            rope_scaling=LLAMA31_SCALING, max_seq_len=131072),
    "llama3_405b": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                             vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.2,
                             rope_theta=500000.0, rope_scaling=LLAMA31_SCALING,
                             max_seq_len=131072),
    # Llama 2: multi-head attention, 32k vocabulary, 4k context.
    "llama2_7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, multiple_of=256,
                           rope_theta=10000.0, max_seq_len=4096),
    "llama2_13b": LlamaArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000,
                            multiple_of=256, rope_theta=10000.0, max_seq_len=4096),
    # Mixtral: 8 experts, top-2 softmax routing, 32k vocabulary. mixtral_debug is the debug
    # model's shape with 8 small experts (CPU tests and dtrain/recipes/mixtral_debug.toml).
    "mixtral_debug": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=4096,
                               rope_theta=1000000.0, max_seq_len=2048, n_experts=8, moe_top_k=2,
                               moe_hidden_size=256, moe_aux_loss_coeff=0.01),
    # 46.7B parameters, 12.9B active per token.
    "mixtral_8x7b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              rope_theta=1000000.0, max_seq_len=32768, n_experts=8,
                              moe_top_k=2, moe_hidden_size=14336, moe_aux_loss_coeff=0.02),
    # 141B parameters, 39B active per token.
    "mixtral_8x22b": LlamaArgs(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8,
                               vocab_size=32768, rope_theta=1000000.0, max_seq_len=65536,
                               n_experts=8, moe_top_k=2, moe_hidden_size=16384,
                               moe_aux_loss_coeff=0.001),
    # Qwen3-MoE (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B config.json): Qwen3's attention
    # (q/k RMSNorm, head_dim 128, 4 KV heads), 128 experts, top-8 softmax renormalised, every
    # block MoE (intermediate_size, the dense width, is unused), untied, native context 40960.
    # 30.5B parameters, 3.3B active per token.
    "qwen3_30b_a3b": LlamaArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_size=128,
                               vocab_size=151936, ffn_hidden_size=6144, norm_eps=1e-6,
                               rope_theta=1000000.0, max_seq_len=40960, qk_norm=True,
                               n_experts=128, moe_top_k=8, moe_hidden_size=768,
                               moe_norm_topk=True, moe_aux_loss_coeff=0.001),
    # 235B parameters, 22B active per token.
    "qwen3_235b_a22b": LlamaArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_size=128,
                                 vocab_size=151936, ffn_hidden_size=12288, norm_eps=1e-6,
                                 rope_theta=1000000.0, max_seq_len=40960, qk_norm=True,
                                 n_experts=128, moe_top_k=8, moe_hidden_size=1536,
                                 moe_norm_topk=True, moe_aux_loss_coeff=0.001),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): multi-head latent attention (128 heads,
    # queries through a 1,536-wide latent, keys and values from a 512-wide one, 128 + 64 rotary
    # query/key channels, 128 value channels), 3 dense blocks of 18,432 then 58 MoE blocks of
    # 256 routed experts (2,048 wide) and one shared expert; top 8 of a sigmoid router with
    # expert bias, from the best 4 of 8 expert groups, weights normalised and scaled by 2.5;
    # YaRN to 163,840 positions; untied; one multi-token-prediction depth. The balance loss is
    # the report's complementary sequence-wise one at alpha 0.0001 (section 4.2).
    # 671B parameters, 37B active per token (the MTP depth: 11.6B more).
    "deepseek_v3_671b": LlamaArgs(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_size=18432,
        norm_eps=1e-6, rope_theta=10000.0, rope_scaling=DEEPSEEK_V3_YARN, max_seq_len=163840,
        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_experts=256, moe_layers=tuple(range(3, 61)),
        moe_top_k=8, moe_hidden_size=2048, moe_router="sigmoid", moe_norm_topk=True,
        moe_shared_hidden=2048, moe_n_group=8, moe_topk_group=4, moe_routed_scale=2.5,
        moe_aux_loss_coeff=0.0001, moe_aux_loss_type="seq_aux_loss", mtp_depths=1),
    # The DeepSeek-V3 16B of torchtitan (torchtitan/models/deepseek_v3/__init__.py, flavor
    # "16B") and Megatron-Bridge: DeepSeek-V2-Lite's shape. MLA without a query latent (16
    # heads), 1 dense block of 10,944 then 26 MoE blocks of 64 routed experts (1,408 wide) and
    # two shared ones (one of 2,816), top 6 of a softmax router, weights not renormalised; YaRN
    # with mscale 0.7 over torchtitan's 16,384 positions; vocabulary 102,400; no MTP. Balance
    # loss: DeepSeek-V2-Lite's config.json (aux_loss_alpha 0.001, seq_aux).
    # 15.7B parameters, 2.4B active per token (without the input embedding).
    "deepseek_v3_16b": LlamaArgs(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_size=10944,
        norm_eps=1e-6, rope_theta=10000.0, rope_scaling=DEEPSEEK_V2_LITE_YARN,
        max_seq_len=16384, attention="mla", q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_experts=64,
        moe_layers=tuple(range(1, 27)), moe_top_k=6, moe_hidden_size=1408,
        moe_router="softmax", moe_norm_topk=False, moe_shared_hidden=2816,
        moe_aux_loss_coeff=0.001, moe_aux_loss_type="seq_aux_loss"),
}
