"""Generation through the pipeline: a Hugging Face causal LM split over pp × tp ranks, each stage keeping the
key/value cache of its own layers; greedy or seeded temperature / top-p decoding of batched, left-padded prompts
(`pipetrain generate`, and samples during `pipetrain train --sample-every`). See docs/generate.md."""

from pipetrain.generate.loop import Generated, Placement, Route, generate_tokens
from pipetrain.generate.prompts import PromptBatch, left_pad
from pipetrain.generate.sampling import Sampling, Stopping, next_tokens

__all__ = ["Generated", "Placement", "Route", "generate_tokens", "PromptBatch", "left_pad", "Sampling", "Stopping",
           "next_tokens"]
