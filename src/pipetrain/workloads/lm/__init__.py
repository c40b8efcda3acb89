"""The built-in language model: a GPT-style decoder (model, TP plan, presets) on a token corpus."""
