"""Tiny mixture-of-experts folders, one per MoE family, made with each family's own transformers config class and
written by `save_pretrained` (experts stored one by one, as transformers writes them): 4 layers, hidden 64, top-2
of 4 or 8 experts, the load-balancing loss on (`output_router_logits`, coefficient `AUX_COEF`) where the family's
causal LM has one; each with what sets it apart switched on (Qwen3-MoE's dense first layer, Qwen2-MoE's shared
expert, DeepSeek-V3's dense first layer, latent attention, group-limited routing and a non-zero balancing bias,
GPT-OSS's sinks and alternating sliding windows)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, SEQ = 96, 16
#: the load-balancing coefficient: large enough that dropping the loss moves the routers' gradients far past the
#: parity tolerance (tests/unit/test_moe.py checks it)
AUX_COEF = 0.1


def moe_configs() -> dict:
    """model type -> a tiny config of that MoE family."""
    import transformers

    common = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "output_router_logits": True,
              "router_aux_loss_coef": AUX_COEF, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
              "num_experts_per_tok": 2}
    return {
        "qwen3_moe": transformers.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                                 num_experts=8, head_dim=16, mlp_only_layers=[0]),
        "qwen2_moe": transformers.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, num_experts=8),
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4),
        "olmoe": transformers.OlmoeConfig(**common, intermediate_size=32, num_experts=8),
        "deepseek_v3": transformers.DeepseekV3Config(
            **common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_group=2, topk_group=1,
            first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "gpt_oss": transformers.GptOssConfig(**common, intermediate_size=32, num_local_experts=4, head_dim=16,
                                             sliding_window=8),
    }


def moe_folder(folder: Path, name: str, seed: int = 0) -> torch.nn.Module:
    """Save the tiny `name` model (seeded) to `folder`; returns the transformers model saved."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_configs()[name])
    with torch.no_grad():
        for module in model.modules():  # DeepSeek-V3: a bias that changes which experts are chosen
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    return model
