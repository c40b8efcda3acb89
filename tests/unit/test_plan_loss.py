"""What the last stage holds besides its blocks' activations (`pipetrain.plan.loss`): the loss's saved log-softmax,
a logits-sized fp32 tensor per micro-batch in flight, for every cross-entropy over the vocabulary, recomputation or
not; and its outputs, kept by torch's schedule to the step's end and merged there into one more copy. Exact
arithmetic: the figures below are compared with `==` or to 1e-9 relative."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.plan.hardware import DEFAULT_NETWORK, default_device
from pipetrain.plan.loss import (BACKWARD_TEMPORARIES, VOCAB_PARALLEL_BACKWARD_TEMPORARIES, keeps_log_softmax,
                                last_stage, log_softmax_bytes, with_loss)
from pipetrain.plan.model import BlockCost, TensorSplit
from pipetrain.plan.predict import Layout, predict
from pipetrain.plan.schedules import schedule_order
from pipetrain.plan.simulate import StageCost, simulate
from pipetrain.plan.transformer import sizes_from_config

SEQ, VOCAB = 128, 1024
LOGITS = 4.0 * SEQ * VOCAB  # one sample's fp32 logits (the profile's last block's output)
DEVICE = replace(default_device("fp32"), baseline_bytes=0.0, activation_factor=1.0, memory_bytes=1e15)


class _TokenLoss:
    perplexity = True


class _ClassLoss:
    perplexity = False


class _WithAux:  # a mixture of experts' load-balancing term around a token loss
    perplexity = False
    base = _TokenLoss()


def _blocks() -> list[BlockCost]:
    layer = dict(params=1000, param_bytes=4000.0, activation_bytes=5000.0, output_bytes=2000.0, forward_s=1e-4,
                 backward_s=2e-4)
    return ([BlockCost(name=f"layer{i}", **layer) for i in range(3)]
            + [BlockCost(name="head", params=1000, param_bytes=4000.0, activation_bytes=3000.0,
                         output_bytes=LOGITS, forward_s=1e-4, backward_s=2e-4)])


def test_the_log_softmax_is_tokens_times_vocabulary_in_fp32():
    assert log_softmax_bytes(SEQ, VOCAB) == LOGITS
    assert log_softmax_bytes(SEQ, VOCAB, element=2) == LOGITS / 2


def test_only_vocabulary_cross_entropies_keep_one():
    assert keeps_log_softmax(_TokenLoss()) and keeps_log_softmax(_WithAux())
    assert not keeps_log_softmax(_ClassLoss()) and not keeps_log_softmax(None)
    assert with_loss(_blocks(), _TokenLoss())[-1].loss_bytes == LOGITS
    assert with_loss(_blocks(), _TokenLoss(), output_element=2)[-1].loss_bytes == 2 * LOGITS  # bf16 logits
    assert with_loss(_blocks(), _ClassLoss()) == _blocks()


def test_the_last_stage_holds_the_loss_whether_or_not_the_micro_batch_recomputes():
    cost = StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=100.0, input_bytes=10.0)
    head = replace(_blocks()[-1], loss_bytes=7.0, output_bytes=3.0)
    out = last_stage(cost, head, samples=2)
    assert (out.activation_bytes, out.held_bytes, out.recompute_bytes, out.kept_bytes) == (114.0, 24.0, 114.0, 6.0)
    kept = last_stage(replace(cost, held_bytes=30.0, recompute_bytes=60.0), head, samples=2)
    assert (kept.held_bytes, kept.recompute_bytes) == (44.0, 74.0)
    assert last_stage(cost, replace(head, loss_bytes=0.0, output_bytes=0.0), samples=2) == cost


def test_kept_outputs_stay_to_the_step_end_and_are_merged_there():
    """One stage, 4 micro-batches: GPipe holds all activations and outputs after the forwards; 1F1B's peak is the
    end of the step when outputs outweigh activations (all 4 kept, and their merged copy)."""
    order = schedule_order("gpipe", 1, 4)
    big = StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=10.0, kept_bytes=1.0)
    assert simulate(order, [big]).peak_activation_bytes == (4 * 10.0 + 4 * 1.0,)
    small = replace(big, activation_bytes=1.0, kept_bytes=5.0)
    assert simulate(order, [small]).peak_activation_bytes == (2 * 4 * 5.0,)
    stages = [StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=10.0),
              StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=10.0, kept_bytes=1.0)]
    peaks = simulate(schedule_order("1f1b", 2, 4), stages).peak_activation_bytes
    assert peaks == (20.0, 10.0 + 4.0)  # the last stage: one micro-batch in flight, all four outputs at its last


@pytest.mark.parametrize("pp, schedule, checkpoint, in_flight", [
    (1, "gpipe", "never", 4),    # all 4 micro-batches' forwards before the first backward
    (1, "gpipe", "always", 4),   # recomputing the stage does not drop the loss's tensor
    (2, "1f1b", "never", 1),     # the last stage runs each backward right after its forward
])
def test_the_last_stage_holds_one_log_softmax_per_micro_batch_in_flight(pp, schedule, checkpoint, in_flight):
    """... and, as its first backward starts, the loss backward's two temporaries (`BACKWARD_TEMPORARIES`): without
    recomputation exactly in_flight + 2 log-softmaxes more; with it, the peak without the loss was the recomputation's
    (the stage's activations back), which the loss's moment overtakes: more than in_flight, at most in_flight + 2."""
    layout = Layout(dp=2, pp=pp, batch=32, chunks=4, schedule=schedule, checkpoint=checkpoint, dp_mode="fsdp")
    samples = 32 // 2 // 4
    blocks = _blocks()[:-1] + [replace(_blocks()[-1], output_bytes=100.0)]  # outputs too small to set the peak
    without = predict(blocks, layout, DEVICE, DEFAULT_NETWORK).memory_bytes
    lossy = blocks[:-1] + [replace(blocks[-1], loss_bytes=LOGITS)]
    with_it = predict(lossy, layout, DEVICE, DEFAULT_NETWORK).memory_bytes
    assert with_it[:-1] == without[:-1]  # only the last stage computes the loss
    gained = (with_it[-1] - without[-1]) / (samples * LOGITS)
    if checkpoint == "never":
        assert gained == pytest.approx(in_flight + BACKWARD_TEMPORARIES, rel=1e-9)
    else:
        assert in_flight < gained <= in_flight + BACKWARD_TEMPORARIES


def test_a_config_priced_head_outputs_fp32_logits_and_the_loss_keeps_their_log_probabilities():
    sizes = sizes_from_config({"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
                               "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2})
    head = sizes.blocks(SEQ, element=4)[-1]
    assert (head.loss_bytes, head.output_bytes) == (LOGITS, LOGITS)  # fp32 log-probabilities and logits
    assert head.activation_bytes == 2 * 4 * SEQ * 64  # the norm's and the projection's inputs
    blocks = sizes.blocks(SEQ, element=2, vocab_parallel=True)
    bare = blocks[:-1] + [replace(blocks[-1], loss_bytes=0.0, output_bytes=0.0)]
    # one micro-batch of one sample: as its backward starts, the logits' log-probabilities and the loss backward's
    # temporaries (F.cross_entropy's 2; under a vocabulary-parallel head, torch's loss_parallel's 3), each tp rank
    # holding its shard of each (the logits died with the loss's forward, in the last stage's)
    for tp, temporaries in ((1, BACKWARD_TEMPORARIES), (2, VOCAB_PARALLEL_BACKWARD_TEMPORARIES)):
        layout = Layout(dp=1, pp=1, batch=1, chunks=1, tp=tp)
        gained = (predict(blocks, layout, DEVICE, DEFAULT_NETWORK).memory_bytes[0]
                  - predict(bare, layout, DEVICE, DEFAULT_NETWORK).memory_bytes[0])
        assert gained == pytest.approx((1 + temporaries) * LOGITS / tp, rel=1e-9)


def test_the_loss_backward_temporaries_exist_as_each_backward_starts():
    """`last_stage` sets them (per micro-batch: temporaries x the loss's bytes, a tp rank's share when vocabulary-
    parallel); the simulator adds them on top of what the rank holds when a backward starts, not after it."""
    cost = StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=100.0, input_bytes=10.0)
    head = replace(_blocks()[-1], loss_bytes=7.0, output_bytes=3.0)
    assert last_stage(cost, head, samples=2).transient_bytes == BACKWARD_TEMPORARIES * 14.0
    split = replace(head, tensor=TensorSplit(params=1, flops=0.0, traffic=0.0, activation_bytes=0.0, comm_bytes=0.0))
    assert last_stage(cost, split, samples=2, tp=2).transient_bytes == VOCAB_PARALLEL_BACKWARD_TEMPORARIES * 7.0
    assert last_stage(cost, split, samples=2, tp=1).transient_bytes == BACKWARD_TEMPORARIES * 14.0
    order = schedule_order("gpipe", 1, 2)
    stage = StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=10.0, transient_bytes=7.0)
    timeline = simulate(order, [stage])
    assert timeline.running_bytes == (2 * 10.0 + 7.0,)  # both micro-batches held as the first backward starts
    assert simulate(order, [replace(stage, transient_bytes=0.0)]).running_bytes == (20.0,)


def test_fsdp_holds_only_its_shards_at_the_step_end_and_a_block_more_as_it_reduces():
    """After the last backward torch's stage reshards FSDP and reduce-scatters its gradients (`perform_reduce_grad`):
    the step's end holds the shards (weights, gradients, two moments over dp) beside the kept outputs twice; the
    reduction adds the first block's gradients as one flat fp32 input and its shard of the result; DDP keeps all."""
    from pipetrain.plan.predict import reduce_scatter_bytes, static_bytes

    blocks = _blocks()
    fsdp = Layout(dp=4, pp=1, batch=8, chunks=2, dp_mode="fsdp", keep_outputs=True)  # outputs kept: torch's default
    assert static_bytes(blocks, fsdp, resting=True) == 4 * 4000.0 * 4 / 4
    assert static_bytes(blocks, fsdp) == 2 * 4 * 4000.0 + 4 * 4000.0
    ddp = replace(fsdp, dp_mode="ddp")
    assert static_bytes(blocks, ddp, resting=True) == static_bytes(blocks, ddp) == 5 * 4 * 4000.0
    assert reduce_scatter_bytes(blocks, fsdp) == 4.0 * 1000 * (1 + 1 / 4)
    assert reduce_scatter_bytes(blocks, ddp) == reduce_scatter_bytes(blocks, replace(fsdp, fsdp_reshard=True)) == 0.0
    # outputs that outweigh everything: the step's end sets the peak, with the shards only under FSDP
    big = blocks[:-1] + [replace(blocks[-1], output_bytes=1e6)]
    for layout in (fsdp, ddp):
        memory = predict(big, layout, DEVICE, DEFAULT_NETWORK).memory_bytes[0]
        samples = 8 // layout.dp // 2
        assert memory == pytest.approx(static_bytes(big, layout, resting=True) + 2 * 2 * samples * 1e6, rel=1e-9)


def test_pipetrains_engine_holds_no_output_of_the_last_stage():
    """`keep=False` (nobody reads the step's outputs): no kept bytes, and none held with the micro-batch either (the
    last stage computes its loss in its forward, `pipeline.head`: the logits die there, only the loss's log-softmax
    stays), whether the stage recomputes or not."""
    cost = StageCost(forward_s=1.0, backward_s=2.0, activation_bytes=100.0, input_bytes=10.0)
    head = replace(_blocks()[-1], loss_bytes=7.0, output_bytes=3.0)
    out = last_stage(cost, head, samples=2, keep=False)
    assert (out.activation_bytes, out.held_bytes, out.recompute_bytes, out.kept_bytes) == (114.0, 24.0, 114.0, 0.0)
    assert out.transient_bytes == BACKWARD_TEMPORARIES * 14.0
    per_layer = last_stage(replace(cost, held_bytes=30.0, recompute_bytes=60.0), head, samples=2, keep=False)
    assert (per_layer.held_bytes, per_layer.recompute_bytes) == (44.0, 74.0)
    # 1F1B at pp 1 (each backward right after its forward), outputs and log-softmax of 1 MB per micro-batch: kept,
    # the 4 outputs and their merge at the step's end (8 MB); dropped, one micro-batch's log-softmax and two
    # temporaries as its backward starts (3 MB) beside its blocks' 18 KB
    big = _blocks()[:-1] + [replace(_blocks()[-1], output_bytes=1e6, loss_bytes=1e6)]
    layout = Layout(dp=1, pp=1, batch=4, chunks=4, schedule="1f1b")
    kept = predict(big, replace(layout, keep_outputs=True), DEVICE, DEFAULT_NETWORK).memory_bytes[0]
    dropped = predict(big, layout, DEVICE, DEFAULT_NETWORK).memory_bytes[0]
    assert kept - dropped == pytest.approx(8e6 - 3e6 - 18e3, rel=1e-9)


@pytest.mark.parametrize("unit", ["selective", "layer", "stage"])
def test_the_last_stage_holds_no_output_under_any_recomputation(unit):
    """The logits are none of the head's activations and die with the loss's forward, whether or not the head keeps
    its activations (a measured profile's head, no `selective_bytes`, keeps all of them under selective
    recomputation). One micro-batch of 1 sample at pp 1: the output's bytes change nothing; kept (`keep_outputs`),
    the output and its merged copy set the peak at the step's end when they outweigh the rest."""
    blocks = _blocks()
    layout = Layout(dp=1, pp=1, batch=1, chunks=1, schedule="gpipe", checkpoint="always", recompute_unit=unit)
    held = predict(blocks, layout, DEVICE, DEFAULT_NETWORK).memory_bytes[0]
    bare = predict(blocks[:-1] + [replace(blocks[-1], output_bytes=0.0)], layout, DEVICE, DEFAULT_NETWORK)
    assert held == pytest.approx(bare.memory_bytes[0], rel=1e-12)
    big = blocks[:-1] + [replace(blocks[-1], output_bytes=1e9)]
    kept = predict(big, replace(layout, keep_outputs=True), DEVICE, DEFAULT_NETWORK).memory_bytes[0]
    assert kept > 2e9


def test_selective_recomputation_prices_the_head_plain():
    """The engine leaves the model's last block out of selective recomputation (its policy would keep the logits):
    the plan counts all the head's activations (3000 bytes a sample here) even where it knows a selective share (here
    none kept beyond its input, 2000), and times no recomputation of it."""
    blocks = _blocks()
    known = blocks[:-1] + [replace(blocks[-1], selective_bytes=0.0)]
    layout = Layout(dp=1, pp=1, batch=1, chunks=1, schedule="gpipe", checkpoint="always", recompute_unit="selective")
    plain, told = (predict(b, layout, DEVICE, DEFAULT_NETWORK) for b in (blocks, known))
    assert told.memory_bytes == plain.memory_bytes
    assert told.step_s == plain.step_s
    layers = replace(layout, recompute_unit="layer")  # a whole-layer unit still recomputes the head
    assert predict(known, layers, DEVICE, DEFAULT_NETWORK).memory_bytes[0] < plain.memory_bytes[0]
