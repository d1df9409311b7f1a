"""A tiny local model: a byte-level BPE tokenizer trained on local text and a small
random-initialised causal LM, saved and loaded as an ordinary transformers folder.

The tokenizer speaks ChatML (``<|im_start|>{role}\\n{content}<|im_end|>\\n``, the format of
the Qwen models the recipe trains), so the same rendering code (``tmax.agent.policies.hf``)
serves the tiny model and real ones. Nothing here downloads anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from tmax.agent.config import AgentConfig, load_agent_config
from tmax.tasks.native import load_task

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
ROLES = ("system", "user", "assistant", "tool")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
OBSERVATIONS = ("[no output]\n[exit code: 0]", "[exit code: 0]", "[exit code: 1]",
                "[exit code: 2]", "[exit code: 127]", "command not found",
                "No such file or directory", "Permission denied")


def corpus_texts(task_dirs: Iterable[str | Path]) -> list[str]:
    """Local text to train the tokenizer on: each task's instruction and reference solution,
    the agent prompts (repo config and defaults), observation strings, the submit command."""
    texts: list[str] = []
    for d in task_dirs:
        task = load_task(d)
        texts.append(task.instruction)
        solve = task.solution_dir / "solve.sh"
        if solve.is_file():
            body = solve.read_text()
            texts += [body, f"```bash\n{body.strip()}\n```"]
    # model_validate({}): the defaults (AgentConfig() is the same, but mypy without the
    # pydantic plugin reads Field(default, ...) as required)
    for config in (load_agent_config(), AgentConfig.model_validate({})):
        fields = config.fields("")
        texts += [config.system_template.format(**fields),
                  config.text_protocol_template.format(**fields),
                  config.instance_template.format(**fields),
                  config.format_error_template.format(**fields, error="found 0 ```bash "
                                                      "blocks, expected exactly one"),
                  config.submit_command, f"```bash\n{config.submit_command}\n```",
                  f"{config.submit_marker}\n[exit code: 0]"]
    texts += list(OBSERVATIONS) + [f"{role}\n" for role in ROLES]
    return texts


def build_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (any byte string still encodes);
    deterministic for the same texts. Special tokens: ``<|endoftext|>`` (pad, id 0),
    ``<|im_start|>``, ``<|im_end|>`` (eos, as in Qwen instruct models)."""
    texts = list(texts)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False, model_max_length=1 << 20)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, *, n_layers: int = 2,
                     d_model: int = 128, n_heads: int = 4, max_positions: int = 1024,
                     seed: int = 0) -> PreTrainedModel:
    """A random-initialised Llama-style causal LM in float32 (the global RNG is untouched).

    Embeddings are tied to the LM head: in a model this small the two vocab x d_model
    matrices would be a third of all weights, and tying (as the small Qwen models do) lets
    the few SFT examples train input and output embeddings together."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=d_model, intermediate_size=4 * d_model,
        num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.float().eval()


def save_pretrained_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                        path: str | Path) -> Path:
    """Save model and tokenizer to ``path`` atomically: written into a temporary sibling,
    then renamed into place (an existing folder is swapped out and removed)."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        if final.exists():
            old = final.with_name(f".{final.name}.{os.getpid()}.old")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_pretrained_dir(path: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (float32, eval mode) and tokenizer saved by ``save_pretrained_dir`` (or any
    local transformers folder: a fast tokenizer, or a slow one where the folder has only
    that)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval(), tokenizer
