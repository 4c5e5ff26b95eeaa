#!/usr/bin/env python3
"""Tiny ONNX exports of more transformer architectures, with PyTorch references.

The project's main test models (make_models.py: GPT-2, Llama, BERT, Mixtral) cover one
family each; this script adds architectures whose graphs differ in other ways (biases in
the attention projections, sliding-window masks, partial rotary embeddings, parallel
residuals, learned positions from a cumulative sum, GeGLU and logit soft-capping,
relative position buckets, patch convolutions, ALiBi, interleaved rotary, shared
experts). Each model is built from a local `transformers` config (no hub download) with
`torch.manual_seed(0)`, every constant-initialized parameter gets a small seeded
perturbation, and it is exported with the legacy and/or dynamo exporter (per model, see
MODELS; default legacy op17 and dynamo op18):

  extra/<model>.<legacy|dynamo>.op<N>.onnx
  extra/<model>.io.npz               fixed inputs (keys = ONNX graph input names) and
                                     PyTorch's output under `torch_out`
  extra/ref/<stem>.ref.npz|json      loss, gradients and parameters after 5 AdamW steps,
                                     keyed by ONNX initializer name (make_refs.py's format,
                                     `grad/` and `adamw5/` only)

Decoders are exported through a subclass whose forward(input_ids) builds the all-ones
attention mask inside and returns the logits (loss `lm`); encoders return
last_hidden_state (loss `mean`). Every export is checked with onnxruntime on the fixed
inputs and on one other shape.

Usage (see extra/README.md):
    /work/venv-models/bin/python tests/models/make_extra_models.py [--only NAME ...]
    /work/venv-models/bin/python tests/models/make_extra_models.py --more --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
import transformers

HERE = Path(__file__).resolve().parent
OUT = HERE / "extra"
REF = OUT / "ref"
sys.dont_write_bytecode = True
sys.path.insert(0, str(HERE))
import make_models as mm  # noqa: E402
import make_refs as mr  # noqa: E402

SEED = 0
VOCAB = 256
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
FFN = 64  # MLP width: small, to keep every file well under MAX_FILE_BYTES
MAX_POS = 64
BATCH = 2
SEQ = 16
PAD_TAIL = 5
ATOL = 1e-4
MAX_FILE_BYTES = 600_000
IMAGE = 16  # ViT: 16x16 RGB images, 4x4 patches
PATCH = 4

warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def decoder(cls, cfg):
    return mm.causal_lm_logits_class(cls)(cfg)


def common_decoder_kwargs(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )
    base.update(kw)
    return base


def build_qwen2():
    # Biases on q/k/v (not o), GQA, tied embeddings.
    cfg = transformers.Qwen2Config(
        **common_decoder_kwargs(num_key_value_heads=KV_HEADS, tie_word_embeddings=True, attention_dropout=0.0)
    )
    return decoder(transformers.Qwen2ForCausalLM, cfg)


def build_mistral():
    # Sliding-window attention (window 6 < sequence 16): the mask is built in the graph.
    cfg = transformers.MistralConfig(
        **common_decoder_kwargs(
            num_key_value_heads=KV_HEADS, sliding_window=6, tie_word_embeddings=True, attention_dropout=0.0
        )
    )
    return decoder(transformers.MistralForCausalLM, cfg)


def build_phi():
    # Phi-2 style: LayerNorm, parallel attention + MLP, partial rotary (half of each head),
    # gelu_new, biases everywhere (LM head too).
    cfg = transformers.PhiConfig(
        **common_decoder_kwargs(
            num_key_value_heads=HEADS,
            partial_rotary_factor=0.5,
            hidden_act="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    )
    return decoder(transformers.PhiForCausalLM, cfg)


def build_neox():
    # Fused QKV viewed per head, rotary on a quarter of each head, parallel residual.
    cfg = transformers.GPTNeoXConfig(
        **common_decoder_kwargs(
            rotary_pct=0.25,
            use_parallel_residual=True,
            hidden_act="gelu",
            attention_dropout=0.0,
            hidden_dropout=0.0,
            tie_word_embeddings=True,
        )
    )
    return decoder(transformers.GPTNeoXForCausalLM, cfg)


def build_opt():
    # Learned positions from cumsum(attention_mask) + offset 2, ReLU, LayerNorm, tied head.
    cfg = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        ffn_dim=FFN,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS,
        word_embed_proj_dim=HIDDEN,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        tie_word_embeddings=True,
    )
    return decoder(transformers.OPTForCausalLM, cfg)


def build_gemma2():
    # GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), RMSNorm with (1 + w), pre and
    # post norms, attention and final logit soft-capping, alternating sliding window.
    cfg = transformers.Gemma2Config(
        **common_decoder_kwargs(
            num_key_value_heads=KV_HEADS,
            head_dim=HIDDEN // HEADS,
            query_pre_attn_scalar=HIDDEN // HEADS,
            sliding_window=6,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            attention_dropout=0.0,
            tie_word_embeddings=True,
        )
    )
    return decoder(transformers.Gemma2ForCausalLM, cfg)


def build_qwen2_moe():
    # Top-2 of 4 experts, no renormalization of the top-k weights, and a shared expert
    # whose output is gated by a sigmoid.
    cfg = transformers.Qwen2MoeConfig(
        **common_decoder_kwargs(
            num_key_value_heads=KV_HEADS,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
            attention_dropout=0.0,
            tie_word_embeddings=True,
            experts_implementation="batched_mm",
        )
    )
    model = decoder(transformers.Qwen2MoeForCausalLM, cfg)
    impl = model.config._experts_implementation
    assert impl == "batched_mm", f"experts implementation is {impl!r}"
    return model


def build_bloom():
    # ALiBi position biases, fused QKV, LayerNorm on the embeddings, tied head.
    cfg = transformers.BloomConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    return decoder(transformers.BloomForCausalLM, cfg)


def build_gptj():
    # Interleaved rotary (rotate every two: strided slices), parallel attention + MLP.
    cfg = transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_positions=MAX_POS,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=FFN,
        rotary_dim=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    return decoder(transformers.GPTJForCausalLM, cfg)


class RobertaHidden(transformers.RobertaModel):
    """RobertaModel (no pooler) returning only last_hidden_state; positions come from
    cumsum(input_ids != padding_idx)."""

    def __init__(self, config):
        super().__init__(config, add_pooling_layer=False)

    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def build_roberta():
    cfg = transformers.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=MAX_POS + 2,
        type_vocab_size=1,
        pad_token_id=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return RobertaHidden(cfg)


class T5Hidden(transformers.T5EncoderModel):
    """T5 encoder returning only last_hidden_state."""

    def forward(self, input_ids, attention_mask):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def build_t5():
    # Relative position buckets (log-spaced), RMSNorm without mean, gated GELU, no scaling
    # of the attention scores.
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=16,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5Hidden(cfg)


class ViTHidden(transformers.ViTModel):
    """ViTModel (no pooler) returning only last_hidden_state."""

    def __init__(self, config):
        super().__init__(config, add_pooling_layer=False)

    def forward(self, pixel_values):
        return super().forward(pixel_values=pixel_values, return_dict=False)[0]


def build_vit():
    # Patch embedding by a strided Conv, CLS token, learned positions.
    cfg = transformers.ViTConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ViTHidden(cfg)


# More architectures, checked the same way but not committed (the committed files are
# held to about 12 MB): `--more` (or `--only NAME`) makes them, best into another folder
# (`--out /tmp/x`).


def encoder_class(base, inputs, out_index=0, **init_kw):
    """Subclass of an HF encoder whose forward takes `inputs` (by position) and returns
    output `out_index` (0: last_hidden_state; 1: the pooled output, for models whose last
    norm only feeds the pooler)."""
    args = ", ".join(inputs)
    src = (
        f"def forward(self, {args}):\n"
        f"    return base.forward(self, {', '.join(f'{a}={a}' for a in inputs)}, return_dict=False)[{out_index}]\n"
    )
    ns = {"base": base}
    exec(src, ns)  # a real signature, so exporters and `model(**inputs)` see the names

    def __init__(self, config):
        base.__init__(self, config, **init_kw)

    cls = type(base.__name__ + "Hidden", (base,), {"__init__": __init__, "forward": ns["forward"]})
    return cls


TEXT = ("input_ids", "attention_mask")


def text_kwargs(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=MAX_POS + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    base.update(kw)
    return base


def build_falcon():
    cfg = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=True, alibi=False,
        ffn_hidden_size=FFN, max_position_embeddings=MAX_POS, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=None, tie_word_embeddings=True,
    )
    return decoder(transformers.FalconForCausalLM, cfg)


def build_qwen3():
    cfg = transformers.Qwen3Config(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, tie_word_embeddings=True, attention_dropout=0.0))
    return decoder(transformers.Qwen3ForCausalLM, cfg)


def build_gemma3():
    cfg = transformers.Gemma3TextConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, query_pre_attn_scalar=HIDDEN // HEADS,
        sliding_window=6, layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
        tie_word_embeddings=True))
    return decoder(transformers.Gemma3ForCausalLM, cfg)


def build_stablelm():
    cfg = transformers.StableLmConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, qk_layernorm=True, use_parallel_residual=True, use_qkv_bias=True,
        partial_rotary_factor=0.25, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False))
    return decoder(transformers.StableLmForCausalLM, cfg)


def build_olmoe():
    cfg = transformers.OlmoeConfig(**common_decoder_kwargs(
        intermediate_size=16, num_key_value_heads=HEADS, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, output_router_logits=False, attention_dropout=0.0, tie_word_embeddings=True,
        experts_implementation="batched_mm"))
    return decoder(transformers.OlmoeForCausalLM, cfg)


def build_qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, attention_dropout=0.0, tie_word_embeddings=True,
        experts_implementation="batched_mm"))
    return decoder(transformers.Qwen3MoeForCausalLM, cfg)


def build_persimmon():
    cfg = transformers.PersimmonConfig(**common_decoder_kwargs(
        hidden_act="relu2", qk_layernorm=True, partial_rotary_factor=0.5, hidden_dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=False))
    return decoder(transformers.PersimmonForCausalLM, cfg)


def build_nemotron():
    cfg = transformers.NemotronConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, hidden_act="relu2", partial_rotary_factor=0.5,
        attention_dropout=0.0, tie_word_embeddings=False))
    return decoder(transformers.NemotronForCausalLM, cfg)


def build_cohere():
    cfg = transformers.CohereConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, logit_scale=0.25, use_qk_norm=False, attention_dropout=0.0,
        tie_word_embeddings=True))
    return decoder(transformers.CohereForCausalLM, cfg)


def build_phi3():
    cfg = transformers.Phi3Config(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
        tie_word_embeddings=False, pad_token_id=None))
    return decoder(transformers.Phi3ForCausalLM, cfg)


def build_bigcode():
    cfg = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB, n_positions=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=FFN,
        multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return decoder(transformers.GPTBigCodeForCausalLM, cfg)


def build_mpt():
    cfg = transformers.MptConfig(
        d_model=HIDDEN, n_heads=HEADS, n_layers=LAYERS, expansion_ratio=1, max_seq_len=MAX_POS, vocab_size=VOCAB,
        resid_pdrop=0.0, emb_pdrop=0.0, attn_config={"alibi": True, "attn_pdrop": 0},
        no_bias=True, bos_token_id=0, eos_token_id=0)
    return decoder(transformers.MptForCausalLM, cfg)


def build_codegen():
    cfg = transformers.CodeGenConfig(
        vocab_size=VOCAB, n_positions=MAX_POS, n_ctx=MAX_POS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        n_inner=FFN, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=False)
    return decoder(transformers.CodeGenForCausalLM, cfg)


def build_starcoder2():
    cfg = transformers.Starcoder2Config(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, sliding_window=6, use_bias=True, residual_dropout=0.0,
        embedding_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=True))
    return decoder(transformers.Starcoder2ForCausalLM, cfg)


def build_olmo2():
    cfg = transformers.Olmo2Config(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, attention_dropout=0.0, tie_word_embeddings=False))
    return decoder(transformers.Olmo2ForCausalLM, cfg)


def build_xglm():
    cfg = transformers.XGLMConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_POS, d_model=HIDDEN, ffn_dim=FFN, num_layers=LAYERS,
        attention_heads=HEADS, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        bos_token_id=0, eos_token_id=2, pad_token_id=1, scale_embedding=True)
    return decoder(transformers.XGLMForCausalLM, cfg)


def build_llama3_rope():
    # rope_scaling of type llama3, attention and MLP biases, untied.
    cfg = transformers.LlamaConfig(**common_decoder_kwargs(
        num_key_value_heads=KV_HEADS, attention_bias=True, mlp_bias=True, attention_dropout=0.0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    return decoder(transformers.LlamaForCausalLM, cfg)


def build_distilbert():
    cfg = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN, max_position_embeddings=MAX_POS,
        dropout=0.0, attention_dropout=0.0)
    return encoder_class(transformers.DistilBertModel, TEXT)(cfg)


def build_albert():
    # Factorized embeddings (32 -> 64) and one layer's weights shared by both layers.
    cfg = transformers.AlbertConfig(**text_kwargs(embedding_size=32, type_vocab_size=1))
    return encoder_class(transformers.AlbertModel, TEXT, add_pooling_layer=False)(cfg)


def build_electra():
    cfg = transformers.ElectraConfig(**text_kwargs(embedding_size=32, type_vocab_size=1))
    return encoder_class(transformers.ElectraModel, TEXT)(cfg)


def build_deberta_v2():
    cfg = transformers.DebertaV2Config(**text_kwargs(
        type_vocab_size=0, relative_attention=True, max_relative_positions=-1, position_buckets=8,
        pos_att_type=["p2c", "c2p"], position_biased_input=False, share_att_key=True, norm_rel_ebd="layer_norm"))
    return encoder_class(transformers.DebertaV2Model, TEXT)(cfg)


def build_mpnet():
    cfg = transformers.MPNetConfig(**text_kwargs(relative_attention_num_buckets=8))
    return encoder_class(transformers.MPNetModel, TEXT, add_pooling_layer=False)(cfg)


def build_esm():
    cfg = transformers.EsmConfig(**text_kwargs(
        position_embedding_type="rotary", pad_token_id=1, mask_token_id=2, token_dropout=False,
        emb_layer_norm_before=False))
    return encoder_class(transformers.EsmModel, TEXT, add_pooling_layer=False)(cfg)


def build_modernbert():
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=MAX_POS, local_attention=8,
        layer_types=["full_attention", "sliding_attention"], pad_token_id=1, bos_token_id=0, eos_token_id=0,
        cls_token_id=0, sep_token_id=0)
    return encoder_class(transformers.ModernBertModel, TEXT)(cfg)


def build_squeezebert():
    # Grouped 1x1 Conv1d projections.
    cfg = transformers.SqueezeBertConfig(**text_kwargs(type_vocab_size=1, embedding_size=HIDDEN))
    return encoder_class(transformers.SqueezeBertModel, TEXT, out_index=0)(cfg)


def build_convbert():
    # Span-based dynamic convolution: depthwise Conv1d (kernel 9) and unfold.
    cfg = transformers.ConvBertConfig(**text_kwargs(type_vocab_size=1, embedding_size=HIDDEN, conv_kernel_size=3))
    return encoder_class(transformers.ConvBertModel, TEXT)(cfg)


def build_clip_vision():
    cfg = transformers.CLIPVisionConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        image_size=IMAGE, patch_size=PATCH, num_channels=3, attention_dropout=0.0)
    return encoder_class(transformers.CLIPVisionModel, ("pixel_values",), out_index=1)(cfg)


def build_convnext():
    cfg = transformers.ConvNextConfig(
        num_channels=3, patch_size=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=IMAGE,
        layer_scale_init_value=0.5)
    return encoder_class(transformers.ConvNextModel, ("pixel_values",), out_index=1)(cfg)


def build_whisper_encoder():
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN, d_model=HIDDEN, max_source_positions=SEQ, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0)
    return encoder_class(WhisperEncoder, ("input_features",))(cfg)


# name: (builder, kind, options); kind: "decoder" (input_ids -> logits), "text"
# (input_ids, attention_mask -> last_hidden_state), "vision" (pixel_values), "audio"
# (input_features [batch, 8, 32]). Options:
#   exports      (exporter, opset) pairs; default legacy op17 and dynamo op18. Some models
#                are committed with one exporter only, to fit the size budget or because
#                the other exporter fails, and some at other opsets: legacy op14 (no
#                LayerNormalization op: the norm is decomposed), op20 (both exporters'
#                default in torch 2.15) and dynamo op23 (ONNX Attention and
#                RMSNormalization ops).
#   check="reference"  check the export with ONNX's reference evaluator instead of
#                onnxruntime: the dynamo op23 export uses RotaryEmbedding with cos/sin
#                caches of batch 1 for inputs of batch 2, which the reference broadcasts
#                and onnxruntime 1.31 rejects.
#   fold=False   export without constant folding (legacy `do_constant_folding=False`,
#                dynamo `optimize=False`): Gemma's RMSNorm computes `1 + weight`, which
#                folding turns into a new initializer, so the file would not hold the
#                parameter itself (nothing to train). Unfolded graphs also keep the weight
#                Transposes and the exporters' unoptimized op patterns.
# Exporter failures met: T5's dynamo export fails (a view of a non-contiguous attention
# output fails torch.export's decomposition, with any shapes); ModernBERT's dynamo export
# and Cohere's legacy export run but compute something else (onnxruntime disagrees with
# PyTorch too), so those files are not used.
LEGACY = [("legacy", 17)]
DYNAMO = [("dynamo", 18)]
MODELS = {
    "gemma2_tiny": (build_gemma2, "decoder", {"fold": False}),
    "vit_tiny": (build_vit, "vision", {}),
    "whisperenc_tiny": (build_whisper_encoder, "audio", {}),
    "gptj_tiny": (build_gptj, "decoder", {"exports": DYNAMO}),
    "qwen2moe_tiny": (build_qwen2_moe, "decoder", {"exports": DYNAMO}),
    "modernbert_tiny": (build_modernbert, "text", {"exports": LEGACY}),
    "t5enc_tiny": (build_t5, "text", {"exports": LEGACY}),
    "qwen3_tiny": (build_qwen3, "decoder", {"exports": [("dynamo", 23)], "check": "reference"}),
    "opt_tiny": (build_opt, "decoder", {"exports": [("legacy", 14)]}),
    "phi_tiny": (build_phi, "decoder", {"exports": [("legacy", 20)]}),
}
MORE = {
    "mistral_tiny": (build_mistral, "decoder", {}),
    "qwen2_tiny": (build_qwen2, "decoder", {}),
    "neox_tiny": (build_neox, "decoder", {}),
    "bloom_tiny": (build_bloom, "decoder", {}),
    "roberta_tiny": (build_roberta, "text", {}),
    "falcon_tiny": (build_falcon, "decoder", {}),
    "gemma3_tiny": (build_gemma3, "decoder", {"fold": False}),
    "stablelm_tiny": (build_stablelm, "decoder", {}),
    "olmoe_tiny": (build_olmoe, "decoder", {}),
    "qwen3moe_tiny": (build_qwen3_moe, "decoder", {}),
    "persimmon_tiny": (build_persimmon, "decoder", {}),
    "nemotron_tiny": (build_nemotron, "decoder", {"fold": False}),
    "cohere_tiny": (build_cohere, "decoder", {"exports": DYNAMO}),
    "phi3_tiny": (build_phi3, "decoder", {}),
    "bigcode_tiny": (build_bigcode, "decoder", {}),
    "mpt_tiny": (build_mpt, "decoder", {}),
    "codegen_tiny": (build_codegen, "decoder", {}),
    "starcoder2_tiny": (build_starcoder2, "decoder", {}),
    "olmo2_tiny": (build_olmo2, "decoder", {}),
    "xglm_tiny": (build_xglm, "decoder", {}),
    "llama3rope_tiny": (build_llama3_rope, "decoder", {}),
    "distilbert_tiny": (build_distilbert, "text", {}),
    "albert_tiny": (build_albert, "text", {}),
    "electra_tiny": (build_electra, "text", {}),
    "debertav2_tiny": (build_deberta_v2, "text", {}),
    "convbert_tiny": (build_convbert, "text", {}),
    "clipvision_tiny": (build_clip_vision, "vision", {"exports": LEGACY}),
}
REGISTRY = {**MODELS, **MORE}


def make_inputs(kind: str, batch: int, seq: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    if kind == "vision":
        return {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}
    if kind == "audio":
        return {"input_features": torch.randn(batch, 8, 2 * SEQ, generator=gen)}
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen, dtype=torch.int64)
    if kind == "decoder":
        return {"input_ids": ids}
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1:
        mask[1, seq - min(PAD_TAIL, seq - 1):] = 0
    return {"input_ids": ids, "attention_mask": mask}


def build(name: str):
    builder, kind, _ = REGISTRY[name]
    torch.manual_seed(SEED)
    model = builder()
    touched = mm.perturb_constant_params(model, SEED + 1)
    model.eval()
    return model, kind, touched


# ---------------------------------------------------------------------------
# Export and checks
# ---------------------------------------------------------------------------


def exports(name: str) -> list[tuple[str, int]]:
    """(exporter, opset) pairs a model is exported with."""
    return REGISTRY[name][2].get("exports", [("legacy", 17), ("dynamo", 18)])


def fixed_length(kind: str) -> bool:
    """Only the batch is symbolic (images of one size, audio of the model's length)."""
    return kind in ("vision", "audio")


def dyn_axes(kind: str) -> dict:
    return {0: "batch"} if fixed_length(kind) else {0: "batch", 1: "sequence"}


def export_legacy(model, kind, inputs, output_name, path, opset=17, fold=True):
    names = list(inputs)
    dyn = {n: dyn_axes(kind) for n in names}
    dyn[output_name] = dyn_axes(kind) if kind == "decoder" or kind == "text" else {0: "batch"}
    torch.onnx.export(
        model,
        tuple(inputs.values()),
        str(path),
        dynamo=False,
        opset_version=opset,
        input_names=names,
        output_names=[output_name],
        dynamic_axes=dyn,
        do_constant_folding=fold,
    )
    model.eval()


def export_dynamo(model, kind, inputs, output_name, path, opset=18, fold=True):
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("sequence", min=2, max=MAX_POS)
    dims = {0: batch} if fixed_length(kind) else {0: batch, 1: seq}
    prog = torch.onnx.export(
        model,
        tuple(inputs.values()),
        dynamo=True,
        opset_version=opset,
        input_names=list(inputs),
        output_names=[output_name],
        dynamic_shapes={n: dims for n in inputs},
        optimize=fold,
        verify=False,
        report=False,
    )
    prog.save(str(path), external_data=False)
    model.eval()
    strip_metadata(path)


def strip_metadata(path: Path):
    """Drop the dynamo exporter's per-node metadata_props (stack traces, class
    hierarchies, name scopes: about a fifth of a file). make_models.py keeps all but the
    stack traces, so importers still meet metadata_props there."""
    m = onnx.load(str(path), load_external_data=False)
    for node in m.graph.node:
        del node.metadata_props[:]
    onnx.save(m, str(path))


def reference_run(path: Path, feeds: dict) -> np.ndarray:
    """The model's single output by ONNX's reference evaluator."""
    from onnx.reference import ReferenceEvaluator

    outs = ReferenceEvaluator(str(path)).run(None, feeds)
    if len(outs) != 1:
        raise RuntimeError(f"{path.name}: {len(outs)} outputs, expected 1")
    return outs[0]


def check_file(path: Path, kind: str):
    m = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(m)
    for init in m.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            raise RuntimeError(f"{path.name}: initializer {init.name} uses external data")
    for vi in m.graph.input:
        dims = vi.type.tensor_type.shape.dim
        want = 1 if fixed_length(kind) else 2
        if not all(d.dim_param for d in dims[:want]):
            raise RuntimeError(f"{path.name}: input {vi.name} has fixed batch/sequence: {dims}")
    size = path.stat().st_size
    if size >= MAX_FILE_BYTES and path.name.split(".")[0] in MODELS:
        raise RuntimeError(f"{path.name}: {size} bytes, over {MAX_FILE_BYTES}")
    return m


def export_one(name: str) -> list[str]:
    model, kind, touched = build(name)
    opts = REGISTRY[name][2]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"== {name}: {type(model).__name__}, {n_params} parameters, perturbed {len(touched)}", flush=True)
    inputs = make_inputs(kind, BATCH, SEQ, SEED + 2)
    output_name = "logits" if kind == "decoder" else "last_hidden_state"
    for old in OUT.glob(f"{name}.*.onnx"):
        old.unlink()
    files = {f"{k}.op{v}": OUT / f"{name}.{k}.op{v}.onnx" for k, v in exports(name)}
    failures = []
    for k, v in exports(name):
        fn = export_legacy if k == "legacy" else export_dynamo
        k = f"{k}.op{v}"
        try:
            with mm.contextlib_quiet():
                fn(model, kind, inputs, output_name, files[k], opset=v, fold=opts.get("fold", True))
        except Exception as e:
            print(f"   EXPORT FAIL {files[k].name}: {type(e).__name__}: {str(e)[:400]}")
            files[k].unlink(missing_ok=True)
            failures.append(files[k].name)
    model.eval()
    with torch.no_grad():
        torch_out = model(**inputs).float().numpy()
    io = {k: v.numpy() for k, v in inputs.items()}
    io["torch_out"] = torch_out
    np.savez(OUT / f"{name}.io.npz", **io)

    other = make_inputs(kind, 3, 7, SEED + 3)
    with torch.no_grad():
        other_out = model(**other).float().numpy()
    for k, path in files.items():
        if not path.exists():
            continue
        try:
            m = check_file(path, kind)
            runner = reference_run if opts.get("check") == "reference" else mm.ort_run
            got = runner(path, {a: b.numpy() for a, b in inputs.items()})
            d1 = float(np.abs(got - torch_out).max())
            got2 = runner(path, {a: b.numpy() for a, b in other.items()})
            d2 = float(np.abs(got2 - other_out).max())
            ok = d1 < ATOL and d2 < ATOL and got.shape == torch_out.shape
            print(
                f"   {'OK  ' if ok else 'FAIL'} {path.name}: opset {mm.onnx_opset(m)}, {len(m.graph.node)} nodes, "
                f"{path.stat().st_size} bytes, max|ort-torch| {d1:.1e} / {d2:.1e} (other shape)"
            )
            if not ok:
                failures.append(path.name)
        except Exception as e:
            print(f"   FAIL {path.name}: {type(e).__name__}: {str(e)[:400]}")
            failures.append(path.name)
    return failures


# ---------------------------------------------------------------------------
# References (make_refs.py's format, gradients and AdamW only)
# ---------------------------------------------------------------------------


def make_ref(name: str, path: Path) -> dict:
    model, kind, _ = build(name)
    is_decoder = kind == "decoder"
    stem = path.name[: -len(".onnx")]
    g = onnx.load(str(path)).graph
    init_names = {i.name for i in g.initializer}
    graph_inputs = [i.name for i in g.input if i.name not in init_names]
    with np.load(OUT / f"{name}.io.npz") as z:
        io = {k: z[k] for k in z.files}
    inputs = {k: torch.from_numpy(io[k]) for k in graph_inputs}
    with torch.no_grad():
        out = model(**inputs).numpy()
    fwd = float(np.abs(out - io["torch_out"]).max())
    if out.shape != io["torch_out"].shape or not fwd < mr.FWD_ATOL:
        raise RuntimeError(f"{stem}: rebuilt model differs from torch_out by {fwd}")
    mapping, unmapped, not_stored = mr.map_initializers(g, model)
    # Parameters torch does not train (requires_grad=False, e.g. Whisper's sinusoidal
    # positions) are buffers to hzp: listed as unmapped, so they are frozen.
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    for iname, (pname, _) in list(mapping.items()):
        if pname in frozen:
            del mapping[iname]
            unmapped.append(iname)
    not_stored = [n for n in not_stored if n not in frozen]
    if not_stored:
        raise RuntimeError(f"{stem}: torch parameters with no initializer: {not_stored}")
    res = mr.references(model, inputs, is_decoder)
    no_grad = [n for n in res["no_grad"] if n not in frozen]
    if no_grad:
        raise RuntimeError(f"{stem}: parameters without a gradient: {no_grad}")

    def keyed(t, tr):
        a = t.detach().numpy()
        return mr.f32(a.swapaxes(-1, -2) if tr else a)

    arrays = {"loss": mr.f32(res["loss"]), "adamw5_loss": mr.f32(res["adamw5_loss"])}
    for what in ("grad", "adamw5"):
        for iname, (pname, tr) in mapping.items():
            arrays[f"{what}/{iname}"] = keyed(res[what][pname], tr)
    groups = {}
    for iname, (pname, _) in mapping.items():
        groups.setdefault(pname, []).append(iname)
    torch_tied = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        torch_tied.setdefault(id(p), []).append(n)
    meta = {
        "onnx": path.name,
        "io": f"{name}.io.npz",
        "source": "extra",
        "initializers": {k: {"torch": v[0], "transposed": v[1]} for k, v in mapping.items()},
        "unmapped": unmapped,
        "tied_groups": [v for v in groups.values() if len(v) > 1],
        "torch_tied_parameters": [v for v in torch_tied.values() if len(v) > 1],
        "loss": "lm" if is_decoder else "mean",
        "inputs": graph_inputs,
        "adamw": mr.ADAMW,
        "forward_max_abs_diff_vs_torch_out": fwd,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "numpy": np.__version__, "onnx": onnx.__version__},
    }
    REF.mkdir(parents=True, exist_ok=True)
    npz = REF / f"{stem}.ref.npz"
    np.savez_compressed(npz, **arrays)
    (REF / f"{stem}.ref.json").write_text(mr.dump_json(meta))
    return {"stem": stem, "loss": res["loss"], "adamw5_loss": res["adamw5_loss"], "mapped": len(mapping),
            "unmapped": unmapped, "bytes": npz.stat().st_size}


def main() -> int:
    global OUT, REF
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(REGISTRY), help="make only these models")
    ap.add_argument("--more", action="store_true", help="make the models that are not committed too")
    ap.add_argument("--out", type=Path, help=f"write here instead of {OUT}")
    ap.add_argument("--refs-only", action="store_true", help="only remake the references")
    args = ap.parse_args()
    if args.out:
        OUT, REF = args.out, args.out / "ref"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, onnx {onnx.__version__}, "
          f"onnxruntime {ort.__version__}, numpy {np.__version__}")
    OUT.mkdir(parents=True, exist_ok=True)
    failures = []
    for name in args.only or (list(REGISTRY) if args.more else list(MODELS)):
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        if not args.refs_only:
            try:
                failures += export_one(name)
            except Exception as e:
                print(f"   FAIL {name}: {type(e).__name__}: {str(e)[:400]}")
                failures.append(name)
                continue
        # References on one thread, deterministic (as make_refs.py).
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        results = []
        if REF.is_dir():
            for old in REF.glob(f"{name}.*.ref.*"):
                old.unlink()
        for kind in (f"{k}.op{v}" for k, v in exports(name)):
            path = OUT / f"{name}.{kind}.onnx"
            if not path.exists():
                continue
            try:
                s = make_ref(name, path)
            except Exception as e:
                print(f"   REF FAIL {path.name}: {type(e).__name__}: {e}")
                failures.append(path.name + " (ref)")
                continue
            results.append(s)
            print(f"   ref {s['stem']}: loss {s['loss']:.6f}, {s['mapped']} initializers mapped, "
                  f"unmapped {s['unmapped'] or '-'}, {s['bytes']} bytes")
        torch.use_deterministic_algorithms(False)
        if len(results) == 2 and (results[0]["loss"], results[0]["adamw5_loss"]) != (
                results[1]["loss"], results[1]["adamw5_loss"]):
            print(f"   FAIL {name}: legacy and dynamo references differ")
            failures.append(name)
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT}: {total} bytes in all")
    if failures:
        print("FAILED: " + ", ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
