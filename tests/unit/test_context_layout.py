"""Context parallelism without processes: the zig-zag layout, the targets' shift, the masks of a cut sequence
(documents that cross parts stay apart; wholly masked blocks skipped) and the bad-input lines."""

from __future__ import annotations

import pytest
import torch

from pipetrain.config import ParallelConfig, PipelineConfig
from pipetrain.cli import main as cli_main
from pipetrain.context import (ContextMask, SequenceSplit, check_context, check_context_model, check_length,
                               shift_targets, zigzag_index)
from pipetrain.context.ulysses import check_heads
from pipetrain.errors import ConfigError
from pipetrain.pipeline import TokenCrossEntropy


def test_zigzag_gives_each_rank_a_front_and_a_back_part():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([zigzag_index(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_a_length_that_does_not_cut_names_the_lengths_that_do():
    with pytest.raises(ConfigError, match=r"sequence length 10 does not cut into 2 x cp = 4") as info:
        check_length(10, 2)
    assert "multiple of 4 (e.g. 8 or 12)" in info.value.hint
    with pytest.raises(ConfigError, match=r"sequence length 3 does not cut into 2 x cp = 6") as info:
        check_length(3, 3)  # shorter than the parts: the two lengths above
    assert "multiple of 6 (e.g. 6 or 12)" in info.value.hint


def test_targets_shift_before_the_cut():
    targets = torch.tensor([[5, 6, 7, 8]])
    assert shift_targets(targets, -100).tolist() == [[6, 7, 8, -100]]


class _NextToken:
    shifts_targets, ignore_index, perplexity = True, -100, True


def test_split_keeps_each_token_once_with_its_position():
    ids = torch.arange(16).reshape(2, 8)
    parts = [SequenceSplit(2, r) for r in range(2)]
    for part in parts:
        assert isinstance(part.loss(_NextToken()), TokenCrossEntropy)
    cut = [part.inputs((ids,)) for part in parts]
    assert cut[0][0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert cut[1][1].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]  # positions continue across the parts
    targets = [part.targets(ids) for part in parts]
    assert targets[0].tolist() == [[1, 2, 7, -100], [9, 10, 15, -100]]  # shifted before the cut: no token lost


def _mask(positions: torch.Tensor, cp: int, rank: int) -> ContextMask:
    length = positions.shape[1] // cp
    index = torch.stack([zigzag_index(length * cp, cp, r) for r in range(cp)])
    gathered = torch.stack([positions[:, index[r]] for r in range(cp)])
    return ContextMask(None, rank, cp, "ring", index, index[:, None] - gathered)


def _brute(positions: torch.Tensor) -> torch.Tensor:
    """Token t sees token s iff s <= t and both lie in the same document (a document starts where position is 0)."""
    documents = (positions == 0).cumsum(dim=1)
    length = positions.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal & (documents[:, :, None] == documents[:, None, :])


def test_documents_across_ranks_never_see_each_other():
    positions = torch.tensor([list(range(3)) + list(range(7)) + list(range(6)),
                              list(range(9)) + list(range(2)) + list(range(5))])
    for cp in (2, 4):
        want = _brute(positions)
        for rank in range(cp):
            mask = _mask(positions, cp, rank)
            order = mask.index.reshape(-1)
            assert torch.equal(mask.sequence_mask()[:, 0], want[:, order][:, :, order])  # all-to-all's mask
            half = mask.index.shape[1] // 2
            for source in range(cp):
                for a in (0, 1):
                    for b in (0, 1):
                        q = mask.index[rank, a * half:(a + 1) * half]
                        k = mask.index[source, b * half:(b + 1) * half]
                        block = mask.block_mask(source, a, b)
                        expected = want[:, q][:, :, k]
                        if block is False:
                            assert not expected.any()  # a skipped block hides nothing visible
                        elif block is True:
                            assert expected.all()
                        else:
                            assert torch.equal(block[:, 0], expected)


def test_causal_blocks_after_the_queries_are_skipped():
    positions = torch.arange(16)[None]
    mask = _mask(positions, 2, 0)  # rank 0 holds parts 0 and 3, rank 1 parts 1 and 2
    assert mask.block_mask(1, 0, 0) is False and mask.block_mask(1, 0, 1) is False  # part 0 sees nothing later
    assert mask.block_mask(1, 1, 0) is True and mask.block_mask(1, 1, 1) is True  # part 3 sees all of 1 and 2
    assert mask.block_mask(0, 0, 1) is False
    assert not isinstance(mask.block_mask(0, 0, 0), bool)  # the diagonal: causal within the part


def test_ulysses_heads_must_divide_and_the_line_names_the_cp_that_work():
    check_heads(4, 2, 2)
    with pytest.raises(ConfigError, match="9 query and 3 key/value heads, not both divisible by 2") as info:
        check_heads(9, 3, 2)
    assert "--cp among 1, 3" in info.value.hint
    with pytest.raises(ConfigError, match="8 query and 2 key/value heads, not both divisible by 4") as info:
        check_heads(8, 2, 4)  # the query heads divide, GQA's key/value heads do not
    assert "--cp among 1, 2," in info.value.hint
    check_heads(8, 4, 2, tp=2)  # a tp rank's 4 query and 2 key/value heads
    with pytest.raises(ConfigError, match=r"4 query and 2 key/value heads \(2 and 1 per rank of tp=2\), not both "
                                          "divisible by 2") as info:
        check_heads(4, 2, 2, tp=2)
    assert "--cp among 1," in info.value.hint


def test_cp_refuses_what_it_does_not_compose_with():
    assert ParallelConfig(cp=2, pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2)).world_size == 4
    for schedule in ("zero-bubble", "zbv", "dualpipev"):  # a split backward: FSDP2 over the cp ranks, not DDP
        assert ParallelConfig(cp=2, dp_mode="fsdp", pipeline=PipelineConfig(pp=2, schedule=schedule,
                                                                            n_microbatches=4)).world_size == 4
        with pytest.raises(ConfigError, match=r"splits each backward in two, .*\(dp=1 x cp=2, gradients reduced "
                                              r"over both, --dp-mode ddp\)"):
            ParallelConfig(cp=2, pipeline=PipelineConfig(pp=2, schedule=schedule, n_microbatches=4))
    assert ParallelConfig(cp=2, tp=2, dp_mode="fsdp").world_size == 4  # tp splits the heads, cp the tokens
    with pytest.raises(ConfigError, match=r"tp=2 with dp=1 x cp=2 \(gradients reduced over both\) needs --dp-mode "
                                          "fsdp"):
        ParallelConfig(cp=2, tp=2)
    # sequence parallelism cuts each cp rank's part over tp; loss parallelism splits the part's logits
    assert ParallelConfig(cp=2, tp=2, dp_mode="fsdp", sequence_parallel=True, loss_parallel=True).world_size == 4
    assert ParallelConfig(cp=2, dp=4, dp_mode="hsdp", dp_shard=2).world_size == 8  # shard groups of 2 x cp ranks
    with pytest.raises(ConfigError, match="the data-parallel groups span the context ranks"):
        ParallelConfig(cp=2, dp=4, dp_mode="fsdp", fsdp_reshard=2)
    with pytest.raises(ConfigError, match="unknown --cp-attention 'flash'"):
        ParallelConfig(cp=2, cp_attention="flash")
    with pytest.raises(ConfigError, match=r"dp=1 x pp=1 x cp=2 x tp=1 = 2 ranks, but the job has 4"):
        ParallelConfig(cp=2).check_world(4)


def test_experts_split_beside_cp_compose_at_pp1_and_tp1_only():
    assert ParallelConfig(dp=2, ep=2, cp=2).world_size == 4  # each cp rank's ep pair: dp2 x ep2 x cp2
    with pytest.raises(ConfigError, match=r"--ep 2 with --cp 2 and pp=2: expert parallelism beside context "
                                          r"parallelism is built at pp 1 and tp 1 only"):
        ParallelConfig(dp=2, ep=2, cp=2, pipeline=PipelineConfig(pp=2, schedule="1f1b", n_microbatches=2))
    with pytest.raises(ConfigError, match=r"--ep 2 with --cp 2 and tp=2"):
        ParallelConfig(dp=2, ep=2, cp=2, tp=2, dp_mode="fsdp")
    with pytest.raises(ConfigError, match=r"--ep 2 with --cp 2 and --dp-mode hsdp: expert parallelism is built "
                                          r"beside context parallelism or under HSDP, not both at once"):
        ParallelConfig(dp=4, ep=2, cp=2, dp_mode="hsdp", dp_shard=2)
    assert ParallelConfig(dp=4, ep=2, dp_mode="hsdp", dp_shard=2).world_size == 4  # each alone composes


def test_a_model_without_context_attention_is_refused():
    with pytest.raises(ConfigError, match="--cp 2 needs a model whose attention runs over a cut sequence"):
        check_context_model(object(), 2)


class _Model:
    context_parallel = True

    class config:  # noqa: N801 - a transformers config's fields
        num_attention_heads, num_key_value_heads = 9, 3  # SmolLM2-135M's


def test_the_checks_before_ranks_start():
    check_context(_Model(), 3, "ulysses", 96)
    check_context(_Model(), 2, "ring", 96)
    with pytest.raises(ConfigError, match="9 query and 3 key/value heads, not both divisible by 2"):
        check_context(_Model(), 2, "ulysses", 96)
    with pytest.raises(ConfigError, match="sequence length 90 does not cut into 2 x cp = 4"):
        check_context(_Model(), 2, "ring", 90)
    check_context(_Model(), 2, "ring", 96, 3, sequence_parallel=True)  # 48 tokens a cp rank, 16 a tp rank
    with pytest.raises(ConfigError, match="cuts each rank's 44 tokens of a sequence over tp=3 ranks") as info:
        check_context(_Model(), 2, "ring", 88, 3, sequence_parallel=True)
    assert "divisible by 12" in info.value.hint


@pytest.mark.parametrize("flags, says", [
    (["--cp", "2", "--seq-len", "30"], "sequence length 30 does not cut into 2 x cp = 4 equal zig-zag parts"),
    (["--cp", "3", "--cp-attention", "ulysses", "--seq-len", "36"],
     "the model has 4 query and 2 key/value heads, not both divisible by 3"),
    (["--cp", "2", "--tp", "2", "--dp-mode", "fsdp", "--cp-attention", "ulysses", "--seq-len", "32"],
     "4 query and 2 key/value heads (2 and 1 per rank of tp=2), not both divisible by 2"),
])
def test_train_refuses_in_one_line_before_ranks_start(flags, says, tmp_path, capsys):
    """`pipetrain train` with a length or heads that do not split: exit 2, one error line, no traceback."""
    code = cli_main.main(["train", "--workload", "hf", "--preset", "llama-tiny", "--data", "synthetic", "--pp", "1",
                          "--max-steps", "1", "--run-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert says in err
