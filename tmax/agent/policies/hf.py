"""``hf:PATH``: a local transformers model as the inference engine (text protocol).

Token in, token out. The prompt is the tokenizer's own chat template
(``apply_chat_template`` with the generation prompt) tokenised without added special
tokens: the ids vLLM's chat endpoint feeds the model, so this policy, ``tmax serve`` and
vLLM sample from the same prompt. ``render_messages`` (which SFT shares) cuts the text at
each assistant message's content for the loss mask. An assistant message whose exact text
this policy sampled earlier is rendered from the sampled ids (a bounded cache keyed by the
text), so turn k+1's prompt starts with turn k's prompt + completion ids and
``Trajectory.sequences()`` yields one sequence per episode: no retokenisation drift (vLLM
tokenises that text again; its prompt ids are what the trainer gets from it).

Sampling: an own loop with a KV cache. ``logprobs`` are the log-probs of each sampled token
under the distribution it was drawn from, ``log_softmax(logits / temperature)`` in float32
(``temperature == 0`` is greedy; its log-probs are then ``log_softmax(logits)``). A turn
stops at the tokenizer's eos token, as vLLM's does (kept in ``completion_ids`` with its
log-prob, so a trainer teaches the model to stop), or after ``max_new_tokens`` or at the
context end (``finish_reason="length"``).

Concurrency: ``complete`` never blocks the event loop. Requests that wait together are
generated as one left-padded batch (attention mask, position ids from the mask) in a worker
thread; one batch runs at a time, under the lock that ``update_weights`` takes, so
in-flight generations finish on the weights they started with. One event loop at a time.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tmax.agent.policy import Completion, ContextLimit, PolicyError, PolicyUnavailable


def _eos_id(tokenizer: Any) -> int:
    tid = tokenizer.eos_token_id
    if tid is None:
        raise ValueError("the tokenizer has no eos_token: HFPolicy stops a turn at it, as "
                         "vLLM does; set eos_token in the model folder's tokenizer_config.json")
    return int(tid)


def _template_text(tokenizer: Any, messages: list[dict[str, Any]],
                   add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template (chat_template in "
                         "tokenizer_config.json or chat_template.jinja): HFPolicy renders "
                         "chats with the tokenizer's own template, as vLLM does")
    return tokenizer.apply_chat_template(
        [{**m, "content": m.get("content") or ""} for m in messages], tokenize=False,
        add_generation_prompt=add_generation_prompt)


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], text: str
                    ) -> list[tuple[int, int, int]] | None:
    """``(message index, start, end)`` of each assistant message's content in ``text``
    (the chat rendered by the template), found as the template renders the chat before it
    with the generation prompt and then the content verbatim; None when the template
    does not render that way (it rewrites an assistant turn, e.g. drops a think block)."""
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _template_text(tokenizer, messages[:i], add_generation_prompt=True)
        content = m.get("content") or ""
        if not text.startswith(head) or not text.startswith(content, len(head)):
            return None
        spans.append((i, len(head), len(head) + len(content)))
    return spans


def render_messages(tokenizer: Any, messages: list[dict[str, Any]], *,
                    add_generation_prompt: bool = False,
                    sampled: Mapping[str, list[int]] | None = None
                    ) -> tuple[list[int], list[int]]:
    """Token ids of a chat rendered by the tokenizer's own chat template (the text of
    ``apply_chat_template``, tokenised without added special tokens: what vLLM's chat
    endpoint feeds the model), and the SFT loss mask (1 on each assistant message's
    content tokens and on the end-of-turn token (eos) right after it; 0 elsewhere).

    Without assistant messages (a first turn) the ids are the whole text tokenised at once,
    exactly vLLM's prompt. With them, the text is tokenised in pieces cut at each assistant
    content, and ``sampled`` maps an assistant text to the ids it was sampled as (without
    the closing eos): those ids are used instead of tokenising the text again, so a later
    turn's prompt extends the earlier turn's prompt and completion."""
    text = _template_text(tokenizer, messages, add_generation_prompt)
    spans = assistant_spans(tokenizer, messages, text) if any(
        m["role"] == "assistant" for m in messages) else []
    if spans is None:
        raise ValueError("the tokenizer's chat template rewrites assistant messages, so "
                         "their tokens cannot be masked or kept as sampled; use a template "
                         "that renders assistant content verbatim")
    eos = _eos_id(tokenizer)
    ids: list[int] = []
    mask: list[int] = []

    def add_text(piece: str, after_assistant: bool) -> None:
        tokens = tokenizer.encode(piece, add_special_tokens=False) if piece else []
        learn = [0] * len(tokens)
        if after_assistant and tokens and tokens[0] == eos:
            learn[0] = 1  # the end of the assistant's turn is learned with it
        ids.extend(tokens)
        mask.extend(learn)

    at = 0
    for _, start, end in spans:
        add_text(text[at:start], at > 0)
        content = text[start:end]
        body = sampled.get(content) if sampled is not None else None
        if body is None:
            body = tokenizer.encode(content, add_special_tokens=False) if content else []
        ids.extend(body)
        mask.extend([1] * len(body))
        at = end
    add_text(text[at:], at > 0)
    return ids, mask


class HFPolicy:
    """A transformers causal LM answering in the text protocol (one ```bash block)."""

    supports_tools = False

    def __init__(self, model: Any, tokenizer: Any, *, temperature: float = 1.0,
                 max_new_tokens: int = 256, max_context: int | None = None,
                 seed: int | None = None, name: str = "hf", max_batch: int = 16,
                 cache_size: int = 4096):
        if temperature < 0:
            raise ValueError("temperature must be >= 0 (0 = greedy)")
        if max_new_tokens < 1 or max_batch < 1:
            raise ValueError("max_new_tokens and max_batch must be >= 1")
        self.model, self.tokenizer, self.name = model.eval(), tokenizer, name
        self.temperature, self.max_new_tokens, self.max_batch = temperature, max_new_tokens, max_batch
        self.max_context = max_context or model.config.max_position_embeddings
        self.device = next(model.parameters()).device
        self.version = 0
        _template_text(tokenizer, [{"role": "user", "content": ""}], True)  # has a template
        self.eos = _eos_id(tokenizer)
        self.stop_ids = {self.eos}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.batch_sizes: Counter[int] = Counter()
        """How many batches of each size were generated (for tests and tuning)."""
        self._lock = threading.Lock()
        self._sampled: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_size = cache_size
        self._pending: list[tuple[list[int], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | None = None,
                        **options: Any) -> HFPolicy:
        """Load a local transformers folder (e.g. one written by ``save_pretrained_dir``)."""
        from tmax.models.tiny import load_pretrained_dir
        model, tokenizer = load_pretrained_dir(path)
        if device is not None:
            model = model.to(device)  # type: ignore[arg-type]  # transformers' stub of .to
        options.setdefault("name", f"hf:{path}")
        return cls(model, tokenizer, **options)

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt ids for ``messages`` (generation prompt appended): vLLM's (the
        template's text tokenised at once), except that an assistant message this policy
        sampled keeps its sampled ids (``render_messages``)."""
        if any(m["role"] == "assistant" and (m.get("content") or "") in self._sampled
               for m in messages):
            try:
                return render_messages(self.tokenizer, messages, add_generation_prompt=True,
                                       sampled=self._sampled)[0]
            except ValueError:
                pass  # a template that rewrites assistant turns: tokenise its text as vLLM
        text = _template_text(self.tokenizer, messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def complete(self, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Completion:
        if tools:
            raise PolicyError(self.name, "HFPolicy speaks the text protocol (one ```bash "
                              "block); set the agent's protocol to auto or text")
        prompt_ids = self.render(messages)
        if len(prompt_ids) + 1 > self.max_context:
            raise ContextLimit(self.name, f"prompt of {len(prompt_ids)} tokens leaves no room "
                               f"in a context of {self.max_context}")
        ids, logprobs, finish, version = await self._submit(prompt_ids)
        content = self.tokenizer.decode(ids, skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False)
        self._remember(content, ids[:-1] if ids and ids[-1] == self.eos else ids)
        return Completion(content, finish_reason=finish, prompt_ids=prompt_ids,
                          completion_ids=ids, logprobs=logprobs, prompt_tokens=len(prompt_ids),
                          completion_tokens=len(ids), policy_version=version)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy the trainer's weights into this engine's model (blocking: it waits for the
        batch in flight; call it via ``asyncio.to_thread`` from async code)."""
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
            self.version = version

    def _remember(self, text: str, ids: list[int]) -> None:
        self._sampled[text] = list(ids)
        self._sampled.move_to_end(text)
        while len(self._sampled) > self._cache_size:
            self._sampled.popitem(last=False)

    async def _submit(self, prompt_ids: list[int]) -> tuple[list[int], list[float], str, int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((prompt_ids, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        """Generate the waiting requests, a batch at a time, until none wait."""
        while self._pending:
            batch = [(p, f) for p, f in self._pending[:self.max_batch] if not f.done()]
            del self._pending[:self.max_batch]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self._generate, [p for p, _ in batch])
            except Exception as e:  # noqa: BLE001 - the engine failed, not the policy
                error = PolicyUnavailable(self.name, f"generation failed: {e!r}")
                for _, f in batch:
                    if not f.done():
                        f.set_exception(error)
                continue
            for (_, f), result in zip(batch, results):
                if not f.done():
                    f.set_result(result)

    def _generate(self, prompts: list[list[int]]
                  ) -> list[tuple[list[int], list[float], str, int]]:
        """Sample one completion per prompt, as one left-padded batch (worker thread)."""
        with self._lock, torch.no_grad():
            version = self.version
            self.batch_sizes[len(prompts)] += 1
            width = max(map(len, prompts))
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            attention = torch.zeros((len(prompts), width), dtype=torch.long)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
                attention[i, width - len(p):] = 1
            ids, attention = ids.to(self.device), attention.to(self.device)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            budgets = [min(self.max_new_tokens, self.max_context - len(p)) for p in prompts]
            out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                             use_cache=True, logits_to_keep=1)
            cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
            cache_arg = "cache" if hasattr(out, "cache") else "past_key_values"
            tokens: list[list[int]] = [[] for _ in prompts]
            logps: list[list[float]] = [[] for _ in prompts]
            finish = [""] * len(prompts)
            last = positions[:, -1:]
            for _ in range(max(budgets)):
                token, logp = self._sample(out.logits[:, -1, :].float())
                for i, (t, lp) in enumerate(zip(token.tolist(), logp.tolist())):
                    if finish[i]:
                        continue
                    tokens[i].append(t)
                    logps[i].append(lp)
                    if t in self.stop_ids:
                        finish[i] = "stop"
                    elif len(tokens[i]) >= budgets[i]:
                        finish[i] = "length"
                if all(finish):
                    break
                last = last + 1
                attention = torch.cat([attention, attention.new_ones((len(prompts), 1))], -1)
                out = self.model(input_ids=token[:, None], attention_mask=attention,
                                 position_ids=last, use_cache=True, **{cache_arg: cache})
            return [(t, lp, f or "length", version) for t, lp, f in zip(tokens, logps, finish)]

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled token ids [B] and their log-probs [B] from float32 logits [B, V]."""
        if self.temperature == 0:
            logp = torch.log_softmax(logits, -1)
            token = logp.argmax(-1)
        else:
            logp = torch.log_softmax(logits / self.temperature, -1)
            token = torch.multinomial(logp.exp(), 1, generator=self.generator)[:, 0]
        return token, logp.gather(-1, token[:, None])[:, 0]
