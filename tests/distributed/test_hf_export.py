"""Round trip through Hugging Face: a tiny tied Llama folder (with its own tokenizer) fine-tuned for 2 steps at pp=2
from the command line (`train --workload hf --model DIR`), exported with `export --hf`, reloaded with
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`: its logits equal those of the
checkpointed pipelined model (its blocks run unsplit, the parity tests' reference) within fp32 rounding
(rtol 1e-5, atol 1e-5), differ from the folder it started from (the steps moved it), and it is still tied."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipetrain.blocks import build_sequential  # noqa: E402
from pipetrain.checkpoint.export import read_weights  # noqa: E402
from pipetrain.cli import main as cli_main  # noqa: E402
from pipetrain.workloads.hf_causal_lm import HFCausalLM  # noqa: E402
from tests.hf_folders import TEXT, tiny_model_folder  # noqa: E402

SEQ = 16


def test_fine_tuned_model_exports_to_a_folder_transformers_loads_with_the_same_logits(tmp_path):
    source = tiny_model_folder(tmp_path / "tiny-llama")
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(TEXT * 20))
    save = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in sys.path if p])}
    job = subprocess.run([sys.executable, "-m", "pipetrain", "train", "--workload", "hf", "--model", str(source),
                          "--data", str(text), "--seq-len", str(SEQ), "--batch-size", "8", "--max-steps", "2",
                          "--lr", "0.01", "--pp", "2", "--save-dir", str(save), "--no-progress"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "tokenized by tiny-llama" in job.stdout and "ppl" in job.stdout

    out = tmp_path / "exported"
    assert cli_main.main(["export", str(save), str(out), "--hf"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert exported.lm_head.weight is exported.get_input_embeddings().weight  # written tied, loaded tied

    ids = tokenizer("The capital of France is Paris. The cat sat on the mat; the dog sat on the log. " * 2, return_tensors="pt")["input_ids"][:, :SEQ]
    assert ids.shape[1] == SEQ
    model = HFCausalLM.from_folder(source, seq_len=SEQ)
    pipelined = build_sequential(model, seed=0)
    pipelined.load_state_dict(read_weights(save, model))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
        ours = pipelined.eval()(ids)
        before = transformers.AutoModelForCausalLM.from_pretrained(source).eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (theirs - before).abs().max() > 1e-3, "the two steps did not change the model"
