"""An example as token ids and a loss mask, with the tokenizer's own chat template.

* ``text``: the text with the tokenizer's special tokens, then EOS; every token is
  learned, whatever ``--loss-on`` says (a text has no prompt).
* ``prompt``/``completion``: the prompt with the special tokens, then the completion
  and EOS; ``--loss-on assistant`` and ``completion`` learn the completion and EOS,
  ``all`` every token.
* ``messages``: the conversation rendered by ``tokenizer.apply_chat_template``.
  ``assistant`` learns the tokens of every assistant turn, ``completion`` those of
  the last assistant turn, ``all`` every token. The assistant tokens come from the
  template itself when it marks them with ``{% generation %}``
  (``return_assistant_tokens_mask``). Otherwise they are found by rendering
  prefixes, see [Note: assistant masks by prefixes].

[Note: assistant masks by prefixes]
For a template without ``{% generation %}`` markers, the tokens of assistant turn
``i`` are those that ``render(messages[:i + 1])`` adds to
``render(messages[:i], add_generation_prompt=True)``: the turn's content and its
end-of-turn tokens, not the header the generation prompt holds. This is exact only
when each render is a token prefix of the next and of the whole conversation (a
prefix-stable template); it is checked for every turn of every conversation, and a
template that fails it is refused (``ConfigError``: add the markers, or train with
``--loss-on all``), never guessed at.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from zero3_offload.data.bad_record import BadRecord
from zero3_offload.data.example import Example
from zero3_offload.errors import ConfigError

__all__ = ["LOSS_ON", "Renderer"]

LOSS_ON = ("assistant", "completion", "all")
"""What ``--loss-on`` accepts."""
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of consecutive ones in ``mask``."""
    spans, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i))
            start = None
    return spans


class Renderer:
    """Renders examples for one tokenizer and one ``--loss-on``.

    Args:
        tokenizer: a transformers tokenizer (a chat template is needed for ``messages``).
        loss_on: ``"assistant"``, ``"completion"`` or ``"all"``.

    Raises:
        ConfigError: for an unknown ``loss_on``, or no tokenizer.
    """

    def __init__(self, tokenizer: Any, loss_on: str) -> None:
        if loss_on not in LOSS_ON:
            raise ConfigError(f"--loss-on {loss_on!r}: give one of {', '.join(LOSS_ON)}")
        if tokenizer is None:
            raise ConfigError(
                "examples (records or a dataset) need a tokenizer: the model directory has none"
            )
        self.tokenizer, self.loss_on = tokenizer, loss_on
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        self.marked = bool(self.template and _GENERATION.search(self.template))
        self.eos = tokenizer.eos_token_id

    def _encode(self, text: str, *, special: bool) -> list[int]:
        out = self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]
        return list(out)

    def _with_eos(self, ids: list[int]) -> list[int]:
        return [*ids, self.eos] if self.eos is not None and ids[-1:] != [self.eos] else ids

    def render(self, example: Example) -> tuple[list[int], list[int]]:
        """The token ids of ``example`` and its loss mask (1: the token is learned).

        Raises:
            BadRecord: for a conversation the template refuses, or one without an
                assistant turn when only assistant tokens are learned.
            ConfigError: for a conversation and a tokenizer without a chat template, or
                a template that is not prefix-stable (see the note).
        """
        if example.text is not None:
            ids = self._with_eos(self._encode(example.text, special=True))
            return ids, [1] * len(ids)
        if example.prompt is not None:
            assert example.completion is not None  # RecordFormat sets both
            prompt = self._encode(example.prompt, special=True)
            completion = self._with_eos(self._encode(example.completion, special=False))
            learn = 0 if self.loss_on != "all" else 1
            return prompt + completion, [learn] * len(prompt) + [1] * len(completion)
        assert example.messages is not None
        return self._conversation(example)

    def _apply(self, example: Example, messages: Sequence[dict[str, str]], **kw: Any) -> Any:
        import jinja2  # transformers' own dependency, only imported for chat templates

        if not messages:
            return {"input_ids": []}
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), tokenize=True, return_dict=True, **kw
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise BadRecord(example.where, f"the chat template refused it ({exc})") from exc

    def _conversation(self, example: Example) -> tuple[list[int], list[int]]:
        if self.template is None:
            raise ConfigError(
                f"{example.where}: a conversation, but the tokenizer has no chat template: "
                "add one (tokenizer_config.json's chat_template) or give prompt/completion "
                "records"
            )
        messages = list(example.messages or ())
        if self.loss_on == "all":
            ids = list(self._apply(example, messages)["input_ids"])
            return ids, [1] * len(ids)
        if not any(m["role"] == "assistant" for m in messages):
            reason = f"no assistant message: nothing to learn with --loss-on {self.loss_on}"
            raise BadRecord(example.where, reason)
        if self.marked:
            out = self._apply(example, messages, return_assistant_tokens_mask=True)
            ids, spans = list(out["input_ids"]), _runs(out["assistant_masks"])
        else:
            ids, spans = self._prefix_spans(example, messages)
        if self.loss_on == "completion":
            spans = spans[-1:]
        mask = [0] * len(ids)
        for start, end in spans:
            mask[start:end] = [1] * (end - start)
        return ids, mask

    def _prefix_spans(
        self, example: Example, messages: list[dict[str, str]]
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """See [Note: assistant masks by prefixes]."""
        full = list(self._apply(example, messages)["input_ids"])
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            head = self._apply(example, messages[:i], add_generation_prompt=True)
            before = list(head["input_ids"])
            upto = list(self._apply(example, messages[: i + 1])["input_ids"])
            stable = upto[: len(before)] == before and full[: len(upto)] == upto
            if not stable or len(upto) <= len(before):
                raise ConfigError(
                    f"{example.where}: the tokenizer's chat template is not prefix-stable "
                    f"(the conversation rendered up to message {i} is not a token prefix of "
                    "the whole), so its assistant tokens cannot be found: add "
                    "{% generation %} markers to the template, or give --loss-on all"
                )
            spans.append((len(before), len(upto)))
        return full, spans
