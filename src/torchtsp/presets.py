"""Named model shapes (``torchtsp.get_preset``): the test and demo toys, and the shapes of public checkpoints
(their config.json), to try scale with random weights, nothing downloaded."""

from __future__ import annotations

from .config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


# Llama 3.1 / 3.2's RoPE scaling, except the factor, which differs between sizes.
def _llama3_rope(factor: float) -> dict:
    return dict(rope_scaling="llama3", rope_params=(("factor", factor), ("high_freq_factor", 4.0),
                                                    ("low_freq_factor", 1.0),
                                                    ("original_max_position_embeddings", 8192)))


# Qwen3's YaRN as its model cards say to switch it on for 128K: factor 4 over the 32K it was trained at.
_QWEN3_YARN = dict(rope_scaling="yarn", rope_params=(("factor", 4.0), ("original_max_position_embeddings", 32768)))

# Phi-3.5-mini's LongRoPE factors, one per rotated pair of its 96-wide heads (its config.json's rope_scaling, as
# public copies of it give them: the Hub was not reachable when this was written).
_PHI35_SHORT = (1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, *(1.0499999523162842,) * 5,
                1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094,
                1.1699998378753662, 1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378,
                1.8199998140335083, 1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
                1.9899996519088745, *(2.0199997425079346,) * 6, *(2.0299997329711914,) * 9, 2.0799996852874756,
                2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
                2.749999523162842, 2.8399994373321533)
_PHI35_LONG = (1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
               1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
               4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
               17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
               32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
               50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
               62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
               63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
               64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
               64.51000213623047, 64.52999877929688, 64.83999633789062)


def layer_pattern(n_layers: int, every: int) -> tuple[str, ...]:
    """Gemma 3's layer types: every ``every``-th layer full, the others sliding (its sliding_window_pattern)."""
    return tuple(FULL_ATTENTION if (i + 1) % every == 0 else SLIDING_ATTENTION for i in range(n_layers))


# Gemma 3's variants of the layer core, the same in every size.
_GEMMA3 = dict(norm_offset=1.0, sandwich_norm=True, mlp_activation="gelu_tanh", embed_scale=True, qk_norm=True,
               tie_embeddings=True, norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_theta=10_000.0,
               family="gemma3_text")

PRESETS: dict[str, ModelConfig] = {
    # Trains in seconds on a CPU; GQA (g=2) and every head count divisible by 1, 2 and 4.
    "tiny": ModelConfig(),
    # The tiny model with 4 experts (top-2) and a shared expert in every layer: tests and the MoE demo.
    "tiny-moe": ModelConfig(n_experts=4, moe_top_k=2, moe_ffn_dim=192, shared_expert_ffn_dim=128,
                            router_aux_loss_coef=0.01),
    # The tiny model with one KV head (MQA): at D = 2 TP keeps a copy of it on both ranks, TSP half of its tokens on
    # each, so the same cache budget holds twice the tokens under TSP (bench --mode serve's capacity figure).
    "tiny-mqa": ModelConfig(n_kv_heads=1),
    # Toy hybrid models (tests and demos): a sliding and a full layer each, heads wider than dim / n_heads.
    # Gemma 3's layer core: (1 + w) and sandwich norms, GeGLU, scaled embeddings, query_pre_attn_scalar 24.
    "tiny-gemma3": ModelConfig(head_dim=32, layer_types=layer_pattern(2, 2), sliding_window=64,
                               query_pre_attn_scalar=24, **_GEMMA3),
    # Qwen3 with a window in its upper layer (use_sliding_window, max_window_layers 1) and head_dim 32.
    "tiny-qwen3-window": ModelConfig(head_dim=32, qk_norm=True, norm_eps=1e-6, sliding_window=64,
                                     layer_types=(FULL_ATTENTION, SLIDING_ATTENTION)),
    # Mistral v0.1's every-layer window.
    "tiny-mistral-window": ModelConfig(layer_types=(SLIDING_ATTENTION,) * 2, sliding_window=64, family="mistral"),
    # One toy per long-context RoPE type: YaRN x4 over 256 tokens (sequences up to 1024); Phi-3 with LongRoPE (its
    # long factors from 257 tokens on); dynamic NTK x2 from 1024 tokens (no length bound).
    "tiny-yarn": ModelConfig(rope_scaling="yarn", rope_params=(("factor", 4.0),
                                                               ("original_max_position_embeddings", 256))),
    "tiny-longrope": ModelConfig(family="phi3", rope_scaling="longrope",
                                 rope_params=(("short_factor", tuple(1.0 + 0.05 * i for i in range(8))),
                                              ("long_factor", tuple(1.0 + 1.5 * i for i in range(8))),
                                              ("original_max_position_embeddings", 256))),
    "tiny-dynamic": ModelConfig(rope_scaling="dynamic", rope_params=(("factor", 2.0),)),
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=4096),
    # The paper's 7B reference: h=4096, 32 layers, 32 query and 32 KV heads, ffn = 4h.
    "paper-7b": ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=16384, vocab_size=32000, max_seq_len=131072
    ),
    # Llama-3-8B shape (GQA g=4, 128K vocabulary), for planning.
    "llama3-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
    ),
    # The shapes of public checkpoints (their config.json), to try scale with random weights, nothing downloaded.
    # Llama 3.2 1B: tied embeddings, llama3 RoPE scaling by 32 from an 8K pretraining context.
    "llama3.2-1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        tie_embeddings=True,
        **_llama3_rope(32.0),
    ),
    # Llama 3.1 8B: llama3 RoPE scaling by 8.
    "llama3.1-8b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=131072,
        rope_theta=500000.0,
        **_llama3_rope(8.0),
    ),
    # Qwen2.5 7B: q/k/v bias, 28 query and 4 KV heads (g=7), head_dim 128.
    "qwen2.5-7b": ModelConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=152064,
        max_seq_len=131072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
    ),
    # Qwen3 8B: per-head q/k RMSNorm, head_dim 128 = 4096/32.
    "qwen3-8b": ModelConfig(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=12288,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qk_norm=True,
    ),
    # Qwen3 8B with YaRN switched on as Qwen's card says (config.json keeps max_position_embeddings 40960):
    # sequences up to 4 x 32768 = 131072 tokens.
    "qwen3-8b-yarn-128k": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288,
                                      vocab_size=151936, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6,
                                      qk_norm=True, **_QWEN3_YARN),
    # Phi-3.5-mini (3.8B): LongRoPE from 4K to 128K, 32 heads of 96, fused q/k/v and gate/up in its checkpoints.
    "phi-3.5-mini": ModelConfig(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=8192, vocab_size=32064,
                                max_seq_len=131072, family="phi3", rope_scaling="longrope",
                                rope_params=(("short_factor", _PHI35_SHORT), ("long_factor", _PHI35_LONG),
                                             ("original_max_position_embeddings", 4096))),
    # Qwen3 4B: 32 heads of 128 (wider than dim / n_heads = 80), tied embeddings.
    "qwen3-4b": ModelConfig(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728,
                            vocab_size=151936, max_seq_len=40960, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True,
                            tie_embeddings=True),
    # Mistral 7B v0.1: a 4096-token window in every layer.
    "mistral-7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                              max_seq_len=32768, layer_types=(SLIDING_ATTENTION,) * 32, sliding_window=4096,
                              family="mistral"),
    # Gemma 3 (text): 5 local layers (window 512 / 1024, RoPE base 1e4) to 1 global (base 1e6, linear scaling by
    # 8 on 4B and 27B); 27B's heads are narrower than dim / n_heads and its attention scale 168**-0.5.
    "gemma3-1b": ModelConfig(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                             vocab_size=262144, max_seq_len=32768,
                             layer_types=layer_pattern(26, 6), sliding_window=512,
                             **_GEMMA3),
    "gemma3-4b": ModelConfig(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=10240,
                             vocab_size=262208, max_seq_len=131072,
                             layer_types=layer_pattern(34, 6), sliding_window=1024,
                             rope_scaling="linear", rope_params=(("factor", 8.0),), **_GEMMA3),
    "gemma3-27b": ModelConfig(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=21504,
                              vocab_size=262208, max_seq_len=131072,
                              layer_types=layer_pattern(62, 6), sliding_window=1024,
                              rope_scaling="linear", rope_params=(("factor", 8.0),), query_pre_attn_scalar=168,
                              **_GEMMA3),
    # Mixtral 8x7B: 8 experts of width 14336 in every layer, top-2, GQA g=4.
    "mixtral-8x7b": ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1000000.0,
        n_experts=8,
        moe_top_k=2,
        moe_ffn_dim=14336,
        router_aux_loss_coef=0.02,
        family="mixtral",
    ),
    # Qwen2 57B-A14B (Qwen2-MoE): 64 experts of width 2560, top-8, a shared expert of width 20480, q/k/v bias.
    "qwen2-57b-a14b": ModelConfig(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=151936,
        max_seq_len=131072,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        n_experts=64,
        moe_top_k=8,
        moe_ffn_dim=2560,
        shared_expert_ffn_dim=20480,
        moe_norm_topk=False,
        router_aux_loss_coef=0.001,
    ),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
