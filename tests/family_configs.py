"""Tiny configs for every decoder-only ``*ForCausalLM`` family in the installed transformers.

:func:`small_config` starts from the family's default config and shrinks it: the
common size names (:data:`SMALL`) where the config has them, the usual MoE / MLA /
layer-pattern names (:func:`_shrink`), then the family's own entry in
:data:`OVERRIDES`. A family this cannot build (a new one with new names, say) is
reported by tests/test_families.py as skipped with the error.

:data:`OUT_OF_SCOPE` lists the ``MODEL_FOR_CAUSAL_LM_MAPPING`` entries that are not
decoder-only text LMs (encoders used as decoders, the decoder halves of
encoder-decoder models, multimodal wrappers), with the reason.
"""

from __future__ import annotations

import transformers
from transformers import AutoConfig

VOCAB = 97
_TRANSFORMERS = tuple(int(x) for x in transformers.__version__.split(".")[:2])

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

# MoE, MLA and other size names many families share -> small values
_SHRINK = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    n_group=1,
    topk_group=1,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    expert_ffn_hidden_size=32,
    dense_intermediate_size=64,
    shared_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
)

# model_type -> why it is not a decoder-only text LM dtree should wrap
OUT_OF_SCOPE = {
    **{
        t: "an encoder (bidirectional) model used as a decoder"
        for t in (
            "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
            "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm", "xlm-roberta",
            "xlm-roberta-xl", "xmod", "xlnet", "reformer",
        )
    },
    **{
        t: "the decoder half of an encoder-decoder model"
        for t in (
            "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
            "plbart", "prophetnet", "trocr", "whisper",
        )
    },
    **{
        t: "a multimodal model (use its text model's own *ForCausalLM entry where it has one)"
        for t in (
            "blt", "emu3", "fuyu", "gemma3", "gemma3n", "gemma4", "gemma4_unified", "git", "got_ocr2", "llama4",
            "mllama", "moss_transcribe_diarize", "musicgen", "musicgen_melody", "phi4_multimodal", "qwen3_5",
            "qwen3_5_moe", "qwen4_exp", "dots3_note",
        )
    },
}

DROP = object()  # an OVERRIDES value: do not pass this SMALL key to the family's config

# model_type -> config overrides after SMALL and the shrink table
OVERRIDES: dict[str, dict] = {
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=4),
    "gpt_bigcode": dict(num_key_value_heads=DROP),  # derived from multi_query
    "deepseek_v4": dict(num_key_value_heads=1),  # shared-KV multi-query attention
    "deepseek_v2": dict(num_experts_per_tok=2),
    "dbrx": dict(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=128,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
    "dots1": dict(num_local_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    "lfm2": dict(layer_types=["conv", "full_attention"]),  # layer 0 a short convolution
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "gemma3n_text": dict(
        num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=4,
        activation_sparsity_pattern=[0.0, 0.0],
    ),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "zaya": dict(num_experts_per_tok=1),
    # hybrids: attention and recurrent layers side by side, several recurrent heads (fewer
    # key than value heads where the family allows), small states, and transformers'
    # chunked paths crossing chunk boundaries on these short paths
    **{
        name: dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
        for name in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid")
    },
    "kimi_linear": dict(linear_num_heads=2, linear_head_dim=8),
    "minimax": dict(block_size=4),
    # transformers before 5.17 runs Nemotron-H's SSD in an older torch form whose chunked
    # result differs from its own one-chunk result (A_log's gradient by 16% in float64 at
    # chunk_size=4): the reference runs one chunk there
    "nemotron_h": dict(
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        chunk_size=4 if _TRANSFORMERS >= (5, 17) else 64,
    ),
    "granitemoehybrid": dict(
        layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4,
    ),
    "bamba": dict(
        layer_types=DROP, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=2, mamba_chunk_size=4,
    ),
    "falcon_h1": dict(
        layer_types=DROP, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=4,
    ),
    "jamba": dict(
        layer_types=DROP, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        mamba_d_state=8, mamba_dt_rank=4,
    ),
    # global layers with a head dim of their own (32 against the sliding layers' 16)
    **{
        name: dict(head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, global_head_dim=32)
        for name in ("gemma4_text", "gemma4_unified_text")
    },
}

# model_type -> the model type of its nested ``text_config``, built small too (its default is the full model's: the
# assistant of Gemma 4's unified model built 3.5B parameters in 51 s and 14 GB before its test could skip)
NESTED_TEXT = {"gemma4_unified_assistant": "gemma4_unified_text"}
OVERRIDES["gemma4_unified_assistant"] = {"backbone_hidden_size": SMALL["hidden_size"], "num_centroids": 16}

# extra configurations of a family, tested like families: name -> (model_type, overrides)
VARIANTS: dict[str, tuple[str, dict]] = {
    "falcon:new_arch": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    # HF's eager Falcon adds ALiBi twice (dtree refuses it, naming sdpa); sdpa is the reference
    "falcon:alibi": ("falcon", dict(alibi=True, multi_query=False, attn_implementation="sdpa")),
    "falcon:alibi_mq": ("falcon", dict(alibi=True, attn_implementation="sdpa")),
    "gpt_bigcode:mha": ("gpt_bigcode", dict(multi_query=False, n_head=4)),
    # the last two layers reuse the K/V of earlier ones
    # Falcon-H1 with its gated RMSNorm after the SSM (the default gates with silu alone)
    "falcon_h1:rms_norm": ("falcon_h1", dict(mamba_rms_norm=True)),
    "gemma3n_text:kv_shared": (
        "gemma3n_text",
        dict(num_hidden_layers=4, num_kv_shared_layers=2, activation_sparsity_pattern=[0.0] * 4,
             layer_types=["sliding_attention", "full_attention"] * 2),
    ),
}


def _layer_pattern(values: list, n: int) -> list:
    """The distinct entries of a per-layer list in order of first appearance, cycled to ``n``."""
    distinct = list(dict.fromkeys(values))
    return [distinct[i % len(distinct)] for i in range(n)]


def _shrink(default) -> dict:
    out = {k: v for k, v in _SHRINK.items() if _settable(default, k) and getattr(default, k) is not None}
    if "kv_lora_rank" in out:  # multi-head latent attention: head_dim is the rope part, K/V per query head
        out.update(head_dim=out["qk_rope_head_dim"], num_key_value_heads=SMALL["num_attention_heads"])
    lists = {
        k: getattr(default, k)
        for k in ("layer_types", "mlp_layer_types")
        if isinstance(getattr(default, k, None), list) and _settable(default, k)
    }
    n = max([2] + [len(set(v)) for v in lists.values()])
    if lists:
        out["num_hidden_layers"] = n
        out.update({k: _layer_pattern(v, n) for k, v in lists.items()})
    return out


def _settable(config, name: str) -> bool:
    prop = getattr(type(config), name, None)
    try:
        present = hasattr(config, name)
    except Exception:  # per-layer attributes of heterogeneous configs refuse global reads
        return False
    return present and not (isinstance(prop, property) and prop.fset is None)


def small_config(name: str, **extra):
    """A tiny config of a model type or a :data:`VARIANTS` name (eager attention), or
    raise what building it raised."""
    model_type, variant = VARIANTS.get(name, (name, {}))
    default = AutoConfig.for_model(model_type)
    kwargs = {k: v for k, v in SMALL.items() if _settable(default, k)}
    kwargs.update(_shrink(default))
    kwargs.update(OVERRIDES.get(model_type, {}))
    if model_type in NESTED_TEXT:
        kwargs["text_config"] = small_config(NESTED_TEXT[model_type]).to_dict()
    kwargs.update(variant)
    kwargs.update(extra)
    kwargs = {k: v for k, v in kwargs.items() if v is not DROP}
    kwargs.setdefault("attn_implementation", "eager")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception:
        # some hybrid configs derive their layer pattern from other fields: keep their default
        lists = {k for k in ("layer_types", "mlp_layer_types") if k in kwargs and k not in OVERRIDES.get(model_type, {})}
        if not lists:
            raise
        kwargs = {k: v for k, v in kwargs.items() if k not in lists and k != "num_hidden_layers"}
        kwargs["num_hidden_layers"] = extra.get("num_hidden_layers", variant.get("num_hidden_layers", 4))
        return AutoConfig.for_model(model_type, **kwargs)
