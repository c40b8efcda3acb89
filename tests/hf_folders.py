"""Tiny Hugging Face model folders with a tokenizer of their own, built offline in a second (for tests)."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = ["The capital of France is Paris. The cat sat on the mat; the dog sat on the log. " * 4,
        "It was the best of times, it was the worst of times, it was the age of wisdom.",
        "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,;:!?'\"-()"]
EOS = "<|endoftext|>"
#: a ChatML chat template (as SmolLM2's, without its default system prompt) for `chat_tokenizer`
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `TEXT` (every byte encodes), EOS `<|endoftext|>` at id 0."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS)


def chat_tokenizer():
    """`tiny_tokenizer` with the ChatML tokens `<|im_start|>`, `<|im_end|>` and the chat template `CHATML`."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def tiny_model_folder(folder: Path, family: str = "llama", *, tied: bool = True, tokenizer: bool = True,
                      layers: int = 2, seed: int = 0, chat: bool = False) -> Path:
    """A saved tiny Llama or GPT-2 (tied embeddings by default) with its tokenizer (`chat`: `chat_tokenizer`): a
    `--model DIR` folder."""
    import transformers

    tok = chat_tokenizer() if chat else tiny_tokenizer()
    common = {"vocab_size": len(tok), "tie_word_embeddings": tied, "eos_token_id": tok.eos_token_id,
              "bos_token_id": tok.bos_token_id}
    if family == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          **common)
    else:
        config = transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=128, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, **common)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer:
        tok.save_pretrained(folder)
    return folder


def transformers_names(model) -> dict[str, str]:
    """An `HFCausalLM`'s layout-free parameter names ("block.local") -> the transformers model's names."""
    return {f"{index}.{local}": name for index in range(model.num_blocks)
            for local, name in model.parameter_keys(index).items()}


def family_configs(vocab_size: int = 96) -> dict:
    """A tiny config of each added family, made with its own config class (2 layers, hidden 32, 4 query heads and
    2 key/value heads of 8), each with what sets it apart switched on: Qwen2 with a sliding layer (layer 1, window
    4), Mistral sliding over 4 tokens, Qwen3 and OLMo-2 with their q/k norms, Gemma tied (its default), Phi-3 with
    half of each head rotated (`partial_rotary_factor` 0.5); Granite with the issue's embedding multiplier 12 and
    logits divisor 8 (and its residual and attention multipliers), Cohere and Cohere 2 with logit scale 0.25 (Cohere 2
    sliding over 4 tokens in layer 0), Gemma 2 and Gemma 3 alternating a sliding (4 tokens) and a global layer with
    their logits soft-capped at 0.5 (low enough to act on a random model's logits; the real ones cap at 30), Gemma 3's
    global layer rotating with another base. The last five are tied by default, as their classes are."""
    import transformers

    common = {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
              "bos_token_id": 0, "eos_token_id": 0}
    return {
        "qwen2": transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "qwen3": transformers.Qwen3Config(**common, head_dim=8),
        "mistral": transformers.MistralConfig(**common, sliding_window=4),
        "gemma": transformers.GemmaConfig(**common, head_dim=8),
        "phi3": transformers.Phi3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.5}),
        "olmo2": transformers.Olmo2Config(**common),
        **scaled_configs(vocab_size),
    }


def scaled_configs(vocab_size: int = 96) -> dict:
    """`family_configs`' Granite, Cohere, Cohere 2, Gemma 2 and Gemma 3 (`gemma3_text`): the families that act outside
    their decoder layers (scaled embedding or logits, soft-capped logits)."""
    import transformers

    common = {"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
              "bos_token_id": 0, "eos_token_id": 0}
    alternating = {"head_dim": 8, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    return {
        "granite": transformers.GraniteConfig(**common, embedding_multiplier=12.0, logits_scaling=8.0,
                                              residual_multiplier=0.5, attention_multiplier=0.25),
        "cohere": transformers.CohereConfig(**common, logit_scale=0.25),
        "cohere2": transformers.Cohere2Config(**common, **alternating, logit_scale=0.25),
        "gemma2": transformers.Gemma2Config(**common, **alternating, final_logit_softcapping=0.5),
        "gemma3_text": transformers.Gemma3TextConfig(**common, **alternating, final_logit_softcapping=0.5),
    }


#: the tokenizer styles of `styled_tokenizer`: (pre-tokenizer, BOS added by `tokenizer(text)`, EOS, more specials)
STYLES = {
    "llama3": ("byte", "<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen3": ("byte", None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "gemma": ("gemma", "<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistral": ("sentencepiece", "<s>", "</s>", ["[INST]", "[/INST]"]),
    "phi3": ("sentencepiece", "<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
}
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"


def styled_tokenizer(style: str, template: str | None = None):
    """A tokenizer in the manner of a family's (`STYLES`), trained offline on `TEXT`: byte-level BPE (Llama 3,
    Qwen), SentencePiece-style BPE with `▁` for spaces and a dummy prefix (Mistral, Llama 2, Phi-3), or Gemma's (`▁`,
    no dummy prefix); `tokenizer(text)` adds the family's BOS where it has one. `template`: a file of
    `tests/fixtures/chat_templates` (without `.jinja`) set as its chat template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    kind, bos, eos, more = STYLES[style]
    specials = [t for t in (bos, eos, *more) if t]
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=kind != "byte"))
    if kind == "byte":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        scheme = "first" if kind == "sentencepiece" else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme, split=True)
        alphabet = sorted(set("".join(TEXT).replace(" ", "▁")) | {"▁", "\n"})
    tok.train_from_iterator(TEXT * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                          initial_alphabet=alphabet))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                additional_special_tokens=more)
    if template is not None:
        fast.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return fast
