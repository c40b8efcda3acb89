"""Pretrained Hugging Face decoders: the families pipetrain splits, their text, TP plans and export back."""
