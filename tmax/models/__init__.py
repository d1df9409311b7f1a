"""Local models without a model hub: a byte-level BPE tokenizer trained on the shipped
tasks and prompts, and a tiny random-initialised causal LM (``tmax.models.tiny``).

They make the whole RL loop (rollouts with token ids and log-probs, SFT warm-start, policy
updates) runnable and testable on a CPU-only machine with no downloads. Loading is lazy:
importing this package does not import torch or transformers.
"""
