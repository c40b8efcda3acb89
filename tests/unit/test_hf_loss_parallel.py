"""`--loss-parallel` and `--sequence-parallel` for the Hugging Face workload, without processes: the
vocabulary-parallel embedding and head in its plans (tied copies split alike), the sequence-parallel plans, the
refusals (a vocabulary or a sequence tp does not divide, LoRA on the head, packed documents or a family without a
sequence-parallel plan under --sequence-parallel), and the planner pricing --loss-parallel (`plan --model`, the
train line it prints carrying the flag; the old `--vocab-parallel` still working with a deprecation warning). The
parity of the splits (losses, gradients, parameters) is test_hf_tp's, in the spawned HF job."""

from __future__ import annotations

import json
import shlex

import pytest

transformers = pytest.importorskip("transformers")

from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402

from pipetrain.cli.main import build_parser, main  # noqa: E402
from pipetrain.errors import ConfigError  # noqa: E402
from pipetrain.parallel.tensor import block_plans, check_tensor_parallel  # noqa: E402
from pipetrain.workloads.hf.causal_lm import HFCausalLM  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(**changes) -> HFCausalLM:
    return HFCausalLM(transformers.LlamaConfig(**{**SMALL, **changes}), seq_len=16)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_and_the_head_split_over_the_vocabulary(tied):
    model = _llama(tie_word_embeddings=tied)
    assert bool(model.tied_parameters()) is tied
    plans = block_plans(model, 2, loss_parallel=True)
    (embed,), (head,) = plans[0].values(), plans[-1].values()
    assert list(plans[0]) == ["embed_tokens"] and isinstance(embed, RowwiseParallel)
    assert embed.input_layouts == (Replicate(),)
    assert list(plans[-1]) == ["lm_head"] and isinstance(head, ColwiseParallel)
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output  # the logits stay sharded
    assert block_plans(model, 2)[0] is None and block_plans(model, 2)[-1] is None  # whole without the flag
    gpt2 = HFCausalLM(transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64), seq_len=16)
    assert list(block_plans(gpt2, 2, loss_parallel=True)[0]) == ["wte"]  # the token table, not the positions'


def test_refusals_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match="tp=2 does not divide the 129 vocabulary entries") as info:
        check_tensor_parallel(_llama(vocab_size=129), 2, loss_parallel=True)
    assert "--loss-parallel" in info.value.hint
    check_tensor_parallel(_llama(vocab_size=129), 2)  # without --loss-parallel the vocabulary is not split


def test_lora_on_the_head_is_refused():
    pytest.importorskip("peft")
    from pipetrain.lora.config import LoraSettings
    from pipetrain.lora.model import LoraBlocks

    check_tensor_parallel(LoraBlocks(_llama(), LoraSettings(rank=2, targets="q_proj,v_proj")), 2, loss_parallel=True)
    with pytest.raises(ConfigError, match="--loss-parallel splits lm_head over the vocabulary, but LoRA adapts it"):
        check_tensor_parallel(LoraBlocks(_llama(), LoraSettings(rank=2, targets="q_proj,lm_head")), 2,
                              loss_parallel=True)


def _config(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(dict(SMALL, model_type="llama", vocab_size=32000)))
    return str(tmp_path / "config.json")


def _plan(capsys, tmp_path, *flags: str) -> str:
    assert main(["plan", "--gpus", "4", "--model", _config(tmp_path), "--seq-len", "32", "--batch", "16", "--tp", "2",
                 "--pp", "1", "--dp-modes", "fsdp", "--top", "1", *flags]) == 0
    return capsys.readouterr().out


def _memory(out: str) -> float:
    row = next(line for line in out.splitlines() if line.strip().startswith("1 "))
    return float(row.split()[-1])


def test_plan_prices_loss_parallel_and_its_train_line_carries_it(tmp_path, capsys):
    whole, split = _plan(capsys, tmp_path), _plan(capsys, tmp_path, "--loss-parallel")
    assert _memory(split) < _memory(whole)  # the 32000-entry embedding and head halved, and their logits
    train = next(line.strip() for line in split.splitlines() if line.strip().startswith("pipetrain train"))
    args = build_parser().parse_args(shlex.split(train)[1:])
    assert args.loss_parallel and args.tp == 2 and args.workload == "hf"
    assert "--loss-parallel" not in next(line for line in whole.splitlines() if "pipetrain train" in line)
    with pytest.warns(DeprecationWarning, match="--vocab-parallel is deprecated: pass --loss-parallel"):
        old = _plan(capsys, tmp_path, "--vocab-parallel")
    assert _memory(old) == _memory(split) and "--loss-parallel" in old


def test_sequence_parallel_plans_and_refusals():
    model = _llama()
    plans = block_plans(model, 2, sequence_parallel=True, loss_parallel=True)
    assert set(plans[0]) == {"embed_tokens", "drop"} and set(plans[-1]) == {"norm", "lm_head"}
    layer = plans[1]
    assert "" in layer  # the block takes and returns its sequence shard
    assert {"layer.input_layernorm", "layer.post_attention_layernorm"} <= set(layer)
    assert set(block_plans(model, 2, sequence_parallel=True)[-1]) == {"norm"}
    with pytest.raises(ConfigError, match="sequence length 15 is not divisible by 2"):
        check_tensor_parallel(HFCausalLM(transformers.LlamaConfig(**SMALL), seq_len=15), 2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="packed documents"):
        check_tensor_parallel(HFCausalLM(transformers.LlamaConfig(**SMALL), seq_len=16, documents=True), 2,
                              sequence_parallel=True)
    gemma2 = HFCausalLM(transformers.Gemma2Config(**SMALL, head_dim=16), seq_len=16)
    check_tensor_parallel(gemma2, 2)
    with pytest.raises(ConfigError, match="--sequence-parallel is not available for the Hugging Face gemma2") as info:
        check_tensor_parallel(gemma2, 2, sequence_parallel=True)
    assert "drop --sequence-parallel" in info.value.hint
