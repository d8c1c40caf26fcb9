"""Chat conversations as (text, trained) segments, only the assistant turns trained: rendered
with the tokenizer's chat template (or ``--chat_template``'s), turn by turn so that each turn's
text is found. A tokenizer without a template is refused: there is no format to render in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def chat_segments(messages: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation; only assistant content is trained.

    With a chat template, a turn's text is the difference between the rendering
    of the conversation up to it and the rendering up to the previous turn; an
    assistant turn is split after its header (the ``add_generation_prompt``
    rendering), so the header is not trained.
    """
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(f"chat message {index} must be a {{'role', 'content'}} dict, got {message!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat (messages) data needs a chat template and the tokenizer has none (base models usually have none): "
            "pass --chat_template FILE, a Jinja chat template such as the instruct model's chat_template.jinja"
        )

    def render(prefix: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        if not prefix and not add_generation_prompt:
            return ""
        return tokenizer.apply_chat_template(list(prefix), tokenize=False, add_generation_prompt=add_generation_prompt)

    def new_text(rendering: str, previous: str) -> str:
        if not rendering.startswith(previous):
            raise ValueError(
                "the tokenizer's chat template does not render a conversation's prefix as a prefix of the "
                "whole rendering, so the assistant turns cannot be located for masking"
            )
        return rendering[len(previous) :]

    segments, rendered = [], ""
    for index, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        if is_assistant:
            header = render(messages[:index], add_generation_prompt=True)
            segments.append((new_text(header, rendered), False))
            rendered = header
        rendering = render(messages[: index + 1])
        segments.append((new_text(rendering, rendered), is_assistant))
        rendered = rendering
    return [(text, trained) for text, trained in segments if text]
