"""Chat conversations as (text, trained) segments, only the assistant turns trained: the
conversation is rendered once with the tokenizer's chat template (or ``--chat_template``'s)
and each assistant turn is found in that rendering (Note [Locating assistant turns]). A
tokenizer without a template is refused: there is no format to render in.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jinja2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChatRenderError(ValueError):
    """One conversation cannot be rendered or masked (the caller names its row)."""


# What a template may raise on a conversation it does not accept: raise_exception() and
# undefined attributes are Jinja errors; Python operators in the template raise the others
# (``None + '<|im_end|>'``); transformers refuses an empty conversation with ValueError.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError)
_THINK_OPENS = re.compile(r"\s*<think>")
_THINK_TAG_ENDS = re.compile(r"</?think>\s*$")

# Note [Locating assistant turns]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The trained text of an assistant turn is what the model generates when prompted for it:
# from the end of the assistant header (what ``add_generation_prompt=True`` appends) through
# the token that closes the turn, the first special token after the content. As TRL's
# assistant-only loss and axolotl's train_on_eot do, the closing token is trained and the
# newline a template writes after it is not:
#
#   <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nyo!<|im_end|>\n
#   [------------------------prompt-----------------------][==============trained==============][]
#                                                          ^ header end            ^ answer     ^ turn end
#
# Rendering every prefix of the conversation and taking differences fails on real templates:
# Qwen3 writes the think block only for the turns after the last user message (an earlier
# turn loses its reasoning once a later user message exists), Mistral writes the system
# message into the last user message only, Phi-3 ends a rendering without a generation prompt
# with eos, and some templates cannot render a prefix at all (a lone system message, an
# empty conversation). So the whole conversation is rendered ONCE, that text is what is
# trained on, and each assistant message is searched for in it, in order, after the end of
# the previous one (``cursor``):
#
# 1. Header. The prefix messages[:i] is rendered with and without the generation prompt; the
#    text the prompt adds is the header, what comes before it the context. The header end is
#    where the longest tail of ``context + header`` occurs with its header part after the cursor
#    (the context may reach back before it: two assistant turns in a row): the context tells
#    the assistant header apart from the same text inside a user message, and it also finds
#    the turn where the template moved things around (Mistral's ``sys\n\nhi[/INST]`` in the
#    prefix is ``hi[/INST]`` in the whole rendering). A generation prompt may end in think tags
#    the rendered turns lack (DeepSeek-R1's ``<｜Assistant｜><think>\n``): the header is also
#    tried without them, and the longest cut of it that the content follows wins. A header not
#    found with its context is looked for without it; a prefix the template cannot render
#    borrows the header of another turn, without context; when no header is known or found,
#    the turn starts where its content does.
# 2. Content. The message's content is searched for from the header end, up to the next
#    header: as written, then stripped (Llama 3 and Gemma trim it), then only the answer after
#    ``</think>`` (Qwen3 and DeepSeek-R1 drop past reasoning). When the turn's rendering has a
#    think block the search starts after its ``</think>``, so an answer that also occurs in the
#    reasoning is found where it ends the turn. A think block between the header and the answer
#    is trained: the model writes it.
# 3. Close. The turn ends after the first special token that follows the content (tool calls
#    written after the content are trained with it: the search starts after the last call's
#    function name, since Mistral opens its calls with the special token [TOOL_CALLS]); a special
#    token of the header (such as ``<|im_start|>``) opens the next turn instead, and then the turn
#    ends with its content.
#
# Assistant turns before ``first_trained`` are located the same way (it moves the cursor) but
# stay prompt, and one that is not found is left as prompt. Templates with ``{% generation %}``
# markers would say where the turns are, but few templates have them, so they are not used.


# Note [A row's tools]
# ~~~~~~~~~~~~~~~~~~~~
# Tool-calling data carries, beside its messages, the definitions of the tools the assistant may
# call (a 'tools' column: a list of JSON schemas, or that list as a JSON string, as many hub datasets
# store it). At inference the caller gives them to the template (apply_chat_template(messages,
# tools=...)), which writes them into the system prompt; training renders each row the same way
# (TRL's SFT and DPO trainers do too). A template that ignores them would train the model to call
# tools whose definitions it never sees, so a row with tools whose rendering is the same without
# them is refused, for the run, naming --chat_template.


def row_tools(value: Any) -> dict[str, Any]:
    """The keyword arguments that give a row's 'tools' value to apply_chat_template: {} for none
    (missing, null, empty), {"tools": [...]} for a list or a JSON string of one (Note [A row's
    tools]); ChatRenderError for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as error:
            raise ChatRenderError(f"its 'tools' is a string and not JSON ({error.msg} at column {error.colno})") \
                from None
    if not value:
        return {}
    if not isinstance(value, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in value):
        raise ChatRenderError(f"its 'tools' must be a list of tool definitions (JSON objects), got {str(value)[:60]!r}")
    return {"tools": list(value)}


def chat_segments(
    messages: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, first_trained: int = 0,
    tools: Any = None,
) -> list[tuple[str, bool]]:
    """(text, trained) pieces of a conversation whose texts join into the template's rendering
    of it; the assistant messages from index ``first_trained`` on are trained, each from its
    header's end through its end-of-turn token (Note [Locating assistant turns]). ``tools``: the
    row's tool definitions, given to the template as it takes them at inference (Note [A row's tools]).

    ChatRenderError when this conversation or its tools cannot be rendered or a trained assistant
    message cannot be found in the rendering; ValueError when the tokenizer has no chat template,
    or one that writes no tools and the row has some.
    """
    tools = row_tools(tools)
    messages = list(messages)
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ChatRenderError(f"chat message {index} must be a {{'role', 'content'}} dict, got {message!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat (messages) data needs a chat template and the tokenizer has none (base models usually have none): "
            "pass --chat_template FILE, a Jinja chat template such as the instruct model's chat_template.jinja"
        )
    try:
        rendering = tokenizer.apply_chat_template(messages, tokenize=False, **tools)
        without = tokenizer.apply_chat_template(messages, tokenize=False) if tools else None
    except _RENDER_ERRORS as error:
        raise ChatRenderError(f"the chat template cannot render this conversation: it says {error}") from error
    if tools and rendering == without:
        raise ValueError(
            "the rows have tools (a 'tools' column) and the chat template writes none of them, so the model would "
            "learn to call tools it is never shown: pass --chat_template FILE, a template that writes tools (the "
            "model's own, e.g. Qwen's or Llama 3.1's), or drop the tools column (Note [A row's tools])"
        )

    assistants = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    prompts = {index: _generation_prompt(messages[:index], tokenizer, tools) for index in assistants}
    headers = [prompt[1] for prompt in prompts.values() if prompt and prompt[1]]
    borrowed = ("", headers[0] if headers else "")  # for a prefix that cannot be rendered: a header, no context
    closing = _special_token_pattern(tuple(sorted(_special_tokens(tokenizer))))

    spans: list[tuple[int, int]] = []  # [start, end) of each trained turn in the rendering
    cursor = 0
    for index in assistants:
        context, header = prompts[index] or borrowed
        found, expected = _locate_turn(rendering, messages[index], cursor, context, header, closing)
        if found is None:
            if index < first_trained:
                continue
            message = messages[index]
            raise ChatRenderError(
                f"assistant message {index} (role {message['role']!r}, content {str(message['content'])[:40]!r}) "
                f"is not in the chat template's rendering where its turn was expected; the rendering there holds "
                f"{rendering[max(0, expected - 40) : expected + 80]!r}"
            )
        turn_start, content_end = found
        turn_end = content_end
        calls_end = _tool_calls_end(rendering, messages[index], content_end, closing)
        close = closing.search(rendering, calls_end) if closing else None
        if close and close.group() not in header:
            turn_end = close.end()
        if index >= first_trained:
            spans.append((turn_start, turn_end))
        cursor = turn_end

    segments, position = [], 0
    for start, end in spans:
        segments += [(rendering[position:start], False), (rendering[start:end], True)]
        position = end
    segments.append((rendering[position:], False))
    return [(text, trained) for text, trained in segments if text]


def _tool_calls_end(rendering: str, message: Mapping[str, Any], start: int, closing: re.Pattern[str] | None) -> int:
    """Where the message's tool calls, written after its content, have their last function name in
    ``rendering`` (its arguments follow, then the turn's closing token); ``start`` when it has no
    calls or their names are not there in order before the second special token after ``start``
    (a template that writes no calls leaves them unfound, whatever later turns say). Mistral opens
    the calls with a special token ([TOOL_CALLS]), which must not close the turn (Note [Locating
    assistant turns], 3)."""
    calls = message.get("tool_calls") or ()
    first = closing.search(rendering, start) if calls and closing else None
    if first is None:
        return start
    second = closing.search(rendering, first.end())
    limit, position = second.start() if second else len(rendering), start
    for call in calls:
        function = call.get("function", call) if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        found = rendering.find(name, position, limit) if isinstance(name, str) and name else -1
        if found < 0:
            return start
        position = found + len(name)
    return position


def _generation_prompt(
    prefix: list[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, tools: Mapping[str, Any]
) -> tuple[str, str] | None:
    """(context, header) of the prefix's rendering with the generation prompt: the header is
    what the prompt adds, the context what comes before it; None when the prefix cannot be
    rendered. The two renderings are compared, not subtracted: Phi-3 ends the one without a
    prompt with eos."""
    try:
        plain = tokenizer.apply_chat_template(prefix, tokenize=False, **tools) if prefix else ""
        prompted = tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=True, **tools)
    except _RENDER_ERRORS:
        return None
    common = len(os.path.commonprefix([plain, prompted]))
    return prompted[:common], prompted[common:]


def _locate_turn(
    rendering: str, message: Mapping[str, Any], cursor: int, context: str, header: str, closing: re.Pattern[str] | None
) -> tuple[tuple[int, int] | None, int]:
    """((where the turn's trained text starts, where its content ends), where the content was
    looked for) of an assistant message in ``rendering`` after ``cursor``, None for the pair when
    it is not there (Note [Locating assistant turns]). The header is looked for with its
    context, then without; the longest cut of it that the content follows wins; when no header
    is found the turn starts at its content."""
    for anchor_context in dict.fromkeys([context, ""]):
        cuts = _header_cuts(header) if header else ([0] if anchor_context else [])  # no header: the context alone
        ends = [_find_header(rendering, cursor, anchor_context, header, kept) for kept in cuts]
        for header_end, next_header in filter(None, ends):
            found = _find_content(rendering, message, header_end, next_header, closing)
            if found is not None:
                return (header_end, found[1]), header_end
        if any(ends):  # the header is there and the content is not after it
            return None, next(filter(None, ends))[0]
    return _find_content(rendering, message, cursor, len(rendering), closing), cursor


def _find_header(rendering: str, cursor: int, context: str, header: str, kept: int) -> tuple[int, int] | None:
    """(where the assistant header ends, where the next one starts) in ``rendering``: the first
    occurrence of the longest tail of ``context + header[:kept]`` that holds all of
    ``header[:kept]`` (at or after ``cursor``) and some context (which may lie before it);
    None when there is none."""
    anchor = context + header[:kept]
    needed = kept + (1 if context else 0)  # the whole kept header, and a character of context
    if needed > len(anchor) or _find_tail(rendering, anchor, needed, kept, cursor) < 0:
        return None
    low, high = needed, len(anchor)  # the longest tail found is in [low, high]
    while low < high:
        middle = (low + high + 1) // 2
        found = _find_tail(rendering, anchor, middle, kept, cursor) >= 0
        low, high = (middle, high) if found else (low, middle - 1)
    header_end = _find_tail(rendering, anchor, low, kept, cursor) + low
    next_header = rendering.find(header[:kept], header_end) if kept else -1
    return header_end, next_header if next_header >= 0 else len(rendering)


def _header_cuts(header: str) -> list[int]:
    """The lengths of ``header`` tried, longest first: all of it, then without each think tag it
    ends in (a generation prompt that opens or skips the reasoning, which past turns lack)."""
    cuts, kept = [len(header)], header
    while match := _THINK_TAG_ENDS.search(kept):
        kept = kept[: match.start()]
        cuts.append(len(kept))
    return [cut for cut in dict.fromkeys(cuts) if cut]


def _find_tail(rendering: str, anchor: str, length: int, kept: int, cursor: int) -> int:
    """Where the last ``length`` characters of ``anchor`` occur in ``rendering`` with their last
    ``kept`` (the header's) at or after ``cursor``; -1 when they do not."""
    return rendering.find(anchor[-length:], max(0, cursor - (length - kept)))


def _find_content(
    rendering: str, message: Mapping[str, Any], start: int, end: int, closing: re.Pattern[str] | None
) -> tuple[int, int] | None:
    """[start, end) of the message's content in ``rendering[start:end]`` (see Note [Locating
    assistant turns] for the forms tried); None when no form of it is there."""
    content = message["content"] if message["content"] is not None else ""
    if not isinstance(content, str):
        return None
    forms = [content, content.strip()]
    if "</think>" in content:
        answer = content.split("</think>")[-1]
        forms += [answer, answer.strip()]
    if _THINK_OPENS.match(rendering, start, end):  # the turn opens with reasoning: the answer follows it
        close = closing.search(rendering, start, end) if closing else None  # the reasoning ends before the turn
        think_end = rendering.find("</think>", start, close.start() if close else end)
        start = think_end + len("</think>") if think_end >= 0 else start
    for form in dict.fromkeys(forms):
        found = rendering.find(form, start, end)
        if found >= 0:
            return found, found + len(form)
    return None


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """The tokenizer's special tokens: the named ones and every added token marked special
    (a model's turn markers are often only the latter); not the think tags, which close no turn."""
    tokens = set(getattr(tokenizer, "all_special_tokens", ()))
    for added in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(added, "special", False):
            tokens.add(added.content)
    return {token for token in tokens if token and token not in ("<think>", "</think>")}


@functools.lru_cache(maxsize=8)
def _special_token_pattern(tokens: tuple[str, ...]) -> re.Pattern[str] | None:
    """One regex matching any of ``tokens``, the longest first (Llama 3 has 256 special tokens)."""
    if not tokens:
        return None
    return re.compile("|".join(re.escape(token) for token in sorted(tokens, key=len, reverse=True)))
