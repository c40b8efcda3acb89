"""The decoder's attention with SDPA's causal flag (FlashAttention-eligible on CUDA) against the explicit mask, on
right-padded batches (the corpus's layout): the token loss and every gradient agree to fp32 rounding (rtol 1e-5,
atol 1e-6), and so do the logits of every non-padding position."""

from __future__ import annotations

from dataclasses import replace

import torch

from pipetrain.blocks import build_sequential
from pipetrain.pipeline import IGNORE_INDEX, TokenCrossEntropy
from pipetrain.workloads.lm.gpt import GPT_PRESETS, PAD_ID, GPTModel


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 96, (4, 16), generator=generator)
    lengths = torch.tensor([16, 11, 5, 1])
    pad = torch.arange(16)[None, :] >= lengths[:, None]
    tokens[pad] = PAD_ID  # right padding, as the corpus pads
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = PAD_ID
    targets[targets == PAD_ID] = IGNORE_INDEX
    return tokens, targets


def _run(causal_flag: bool):
    model = build_sequential(GPTModel(replace(GPT_PRESETS["tiny"], causal_flag=causal_flag)), seed=1)
    tokens, targets = _batch()
    logits = model(tokens)
    loss = TokenCrossEntropy().total(logits, targets) / (targets != IGNORE_INDEX).sum()
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}, tokens != PAD_ID


def test_causal_flag_matches_the_explicit_mask_on_right_padding():
    flag_loss, flag_logits, flag_grads, keep = _run(True)
    mask_loss, mask_logits, mask_grads, _ = _run(False)
    torch.testing.assert_close(flag_loss, mask_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flag_logits[keep], mask_logits[keep], rtol=1e-5, atol=1e-6)
    assert flag_grads.keys() == mask_grads.keys()
    for name, grad in flag_grads.items():
        torch.testing.assert_close(grad, mask_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.allclose(flag_logits[~keep], mask_logits[~keep])  # padding positions differ: the test can tell
