"""Reading a transformers `config.json`: the file as JSON, and the `DecoderSizes` fields of its family's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.plan.config_names import CONFIG_NAMES, ConfigNames

__all__ = ["read_config", "size_fields"]


def _number(config: dict[str, Any], name: str, where: str, default: Any = None) -> int:
    value = config.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} is {value!r}, expected a positive integer",
                          hint=f"give the config a positive integer {name}")
    return value


def _flag(config: dict[str, Any], value: str | bool) -> bool:
    return bool(config.get(value, False)) if isinstance(value, str) else value


def size_fields(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The `DecoderSizes` fields of a transformers config given as a dict, read through its family's `ConfigNames`;
    one ConfigError naming the model_type and the families that can be priced for any other."""
    model_type = config.get("model_type")
    names = CONFIG_NAMES.get(model_type)
    if names is None:
        raise ConfigError(
            f"{where} holds a {model_type!r} model, which the planner cannot price: it needs the sizes of a "
            "decoder-only family it knows (layers, hidden and intermediate sizes, query and key/value heads, head "
            "dimension, vocabulary, tied head, gated MLP, biases)",
            hint=f"plan a config of one of: {', '.join(CONFIG_NAMES)}; or profile the model "
                 "(`pipetrain profile`) and pass --profile FILE")
    h = _number(config, names.hidden, where)
    heads = _number(config, names.heads, where)
    kv = _number(config, names.kv_heads, where, heads) if names.kv_heads else heads
    head_dim = _number(config, "head_dim", where, h // heads if h % heads == 0 else None)
    if heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
                          hint="fix the config: each key/value head serves a whole group of query heads")
    width = names.intermediate_default and names.intermediate_default * h
    dropout = config.get(names.dropout, names.dropout_default) if names.dropout else 0
    layers = _number(config, names.layers, where)
    return dict(
        **_moe_sizes(config, names, layers, where),
        model_type=model_type, layers=layers, hidden=h,
        intermediate=_number(config, names.intermediate, where, width) if names.intermediate else 0,
        heads=heads, kv_heads=kv,
        head_dim=head_dim, vocab=_number(config, "vocab_size", where),
        tied=bool(config.get("tie_word_embeddings", names.tied_default)), gated=names.gated,
        fused_qkv=names.fused_qkv, fused_gate_up=names.fused_gate_up,
        layer_norm=names.layer_norm, qkv_bias=_flag(config, names.qkv_bias), o_bias=_flag(config, names.o_bias),
        mlp_bias=_flag(config, names.mlp_bias),
        qk_norm={"head": 2 * head_dim, "projection": (heads + kv) * head_dim}.get(names.qk_norm, 0),
        positions=_number(config, names.positions, where, names.positions_default) if names.positions else 0,
        dropout=float(dropout or 0) > 0)


def _moe_sizes(config: dict[str, Any], names: ConfigNames, layers: int, where: str) -> dict[str, Any]:
    """The mixture-of-experts fields of `DecoderSizes` (none for a dense family)."""
    field = next((name for name in names.experts if config.get(name)), None)
    if field is None:
        return {}
    experts = _number(config, field, where)
    top_k = _number(config, names.top_k, where)
    if top_k > experts:
        raise ConfigError(f"{where}: {names.top_k}={top_k} is more than the {experts} experts ({field})",
                          hint="fix the config: each token goes to at most every expert")
    if names.sparse_layers == "qwen":
        dense = set(config.get("mlp_only_layers") or ())
        step = _number(config, "decoder_sparse_step", where, 1)
        sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    else:
        sparse = (True,) * layers
    shared = _number(config, names.shared_intermediate, where) if names.shared_intermediate and \
        config.get(names.shared_intermediate) else 0
    return {"experts": experts, "top_k": top_k, "sparse": sparse, "shared_intermediate": shared,
            "expert_intermediate": _number(config, names.expert_intermediate, where),
            "shared_gate": names.shared_gate and bool(shared), "expert_bias": names.expert_bias, "sinks": names.sinks}


def read_config(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The JSON of a model folder's `config.json` or of a bare config file, and the file read; one ConfigError for
    a path that is neither."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise ConfigError(f"model folder {str(path)!r} has no config.json",
                          hint="pass a folder written by save_pretrained, or the path of a config.json")
    if not file.is_file():
        raise ConfigError(f"--model {str(path)!r} is neither a model folder nor a config file",
                          hint="pass a folder holding config.json, or the path of a config.json")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {str(file)!r} as a JSON config: {err}",
                          hint="pass a transformers config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(file)!r} is not a JSON object", hint="pass a transformers config.json")
    return config, file
