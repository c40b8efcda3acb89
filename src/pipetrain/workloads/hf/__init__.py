"""Pretrained Hugging Face decoders: the families pipetrain splits, their text, TP plans and export back."""

#: What a rank running a Hugging Face model imports beyond the fork server's own preloads (launch/forkserver.py):
#: `pipetrain train --workload hf`, `generate` and `eval` have their server import it once, for all their ranks.
RANK_IMPORTS = ("transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                "pipetrain.workloads.hf.causal_lm")
