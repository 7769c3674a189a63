"""Turning text into the tokens of a conversation: the model's turns to text, the environment's replies to tokens.

With a chat template (the run renders its prompts with one: ``--apply_chat_template``, or a built-in task whose
tokenizer carries one), an environment reply is a chat message: its tokens are what the template adds to a
conversation when that message follows an assistant turn -- the assistant turn's closing (``<|im_end|>\\n``, minus
the stop token the model already produced), the message, and the next assistant header (the generation prompt).
The model's own tokens are never re-tokenized: they stay exactly as the engine sampled them.

Without a chat template a reply is its text's tokens (no special tokens added), as OpenRLHF appends its
``environment_feedback``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybrid_core.errors import ConfigError

#: A chat template for the tiny built-in tokenizer (its vocabulary: <pad> <bos> <eos> <sep> s0 .. s7): a user
#: message is ``<bos> TEXT <sep>`` (the built-in tasks' prompt format), an assistant message ``TEXT <eos>``, a tool
#: result ``<sep> TEXT`` (the tool's answer right before the model's next turn); the assistant's turn follows with no
#: header.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }} <eos> "
    "{% elif m['role'] == 'tool' %}<sep> {{ m['content'] }} "
    "{% else %}<bos> {{ m['content'] }} <sep> {% endif %}{% endfor %}"
)

_USER, _ASSISTANT = "HYBRIDUSERTEXT", "HYBRIDASSISTANTTEXT"  # stand-ins, found again in the rendered text


class Renderer:
    """Text <-> tokens for one run: ``first_message`` / ``feedback`` tokens, ``action_text`` of a turn."""

    def __init__(self, tokenizer: Any, *, chat_template: bool, stop_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.stop_ids = set(stop_ids)
        if tokenizer.eos_token_id is not None:
            self.stop_ids.add(tokenizer.eos_token_id)
        self._closing: dict[str, str] = {}
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "apply_chat_template",
                "the tokenizer has no chat template to render the environment's messages with.",
                "Drop --apply_chat_template, or use a tokenizer that has one.",
            )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_message(self, text: str) -> list[int]:
        """A new first message from ``reset``: rendered like the run's prompts."""
        if self.chat_template:
            return self.encode(self._render([{"role": "user", "content": text}], True))
        return list(self.tokenizer(text)["input_ids"])  # plain prompts keep the tokenizer's special tokens (BOS)

    def action_text(self, token_ids: Sequence[int]) -> str:
        """The model's turn as its environment sees it: special tokens kept, the final stop token dropped."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def feedback(self, text: str, role: str, action_ids: Sequence[int]) -> list[int]:
        """The tokens of the environment's reply ``text`` after the model's turn ``action_ids``."""
        if not self.chat_template:
            return self.encode(text)
        closing = self.encode(self._assistant_closing())
        if action_ids and closing and closing[0] == action_ids[-1] and action_ids[-1] in self.stop_ids:
            closing = closing[1:]  # the model already closed its turn with the template's own stop token
        return closing + self.encode(self._message(text, role))

    # ---- the template --------------------------------------------------------------------------------------------
    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:
            roles = " -> ".join(m["role"] for m in messages)
            raise ConfigError(
                "apply_chat_template",
                f"the tokenizer's chat template cannot render a conversation {roles}: {type(e).__name__}: {e}.",
                "Return the environment's replies with a role "
                "the template accepts (StepResult(role='user') is the default).",
            ) from e

    def _base(self) -> list[dict]:
        return [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]

    def _assistant_closing(self) -> str:
        """What the template writes after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        if "" not in self._closing:
            text = self._render(self._base(), False)
            if _ASSISTANT not in text:
                raise ConfigError(
                    "apply_chat_template",
                    "the tokenizer's chat template drops the assistant's "
                    "message content, so a conversation cannot be continued with it.",
                    "Use a chat template that renders assistant messages.",
                )
            self._closing[""] = text[text.rindex(_ASSISTANT) + len(_ASSISTANT) :]
        return self._closing[""]

    def _message(self, text: str, role: str) -> str:
        """What the template adds for a ``role`` message after an assistant turn, with the generation prompt."""
        closing = self._assistant_closing()
        rendered = self._render([*self._base(), {"role": role, "content": text}], True)
        tail = rendered[rendered.rindex(_ASSISTANT) + len(_ASSISTANT) :]
        if not tail.startswith(closing):
            raise ConfigError(
                "apply_chat_template",
                "the tokenizer's chat template renders an assistant turn "
                f"differently when a {role!r} message follows it, so the reply cannot be appended to "
                "the tokens the model generated.",
                "Use role 'user' for the environment's replies, or "
                "a template that renders earlier turns the same whatever follows.",
            )
        return tail[len(closing) :]
