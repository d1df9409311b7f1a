"""Training: DPPO on a Hugging Face causal LM with pluggable inference engines."""
