"""Assistant-only masking of chat data on the chat templates model makers publish
(tests/data/chat_templates/, where each came from is in the README there).

The tokenizer is the embedded byte tokenizer with the model's special tokens added, so
every character of the rendering is checked: ``marked`` writes the document with each run
of trained tokens between « and ». What is trained is what the model writes for its turn,
from the end of the assistant header through the token that closes the turn
(Note [Locating assistant turns] in llama_cp/data/chat.py).
"""

import functools
import json
from pathlib import Path

import pytest

from llama_cp.data.chat import ChatRenderError, chat_segments
from llama_cp.data.formats import tokenize_example
from llama_cp.data.tokenizer import byte_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"

#: template file -> (bos, eos, the other special tokens the template writes), as the model sets them
MODELS = {
    "meta-llama-Llama-3.1-8B-Instruct": (
        "<|begin_of_text|>", "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"],
    ),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "google-gemma-2-2b-it": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>"]),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[TOOL_RESULTS]"]),
    "microsoft-Phi-3.5-mini-instruct": (None, "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>"],
    ),
}
LLAMA, QWEN25, QWEN3, GEMMA, MISTRAL, PHI, DEEPSEEK = MODELS

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo!"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "ciao"},
]
LLAMA_SYSTEM = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
)

#: CHAT as each template renders it, trained runs marked (Gemma 2 refuses system messages: without it)
MARKED_CHAT = {
    LLAMA: LLAMA_SYSTEM + "be brief<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n«yo!<|eot_id|>»<|start_header_id|>user<|end_header_id|>\n\n"
    "bye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n«ciao<|eot_id|>»",
    QWEN25: "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "«yo!<|im_end|>»\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n«ciao<|im_end|>»\n<|im_end|>",
    # the last turn's (empty) think block is rendered, and is the model's to write: trained
    QWEN3: "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    "«yo!<|im_end|>»\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
    "«<think>\n\n</think>\n\nciao<|im_end|>»\n<|im_end|>",
    GEMMA: "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n«yo!<end_of_turn>»\n"
    "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n«ciao<end_of_turn>»\n<eos>",
    # Mistral writes the system message into the last user message only when that message ends
    # the conversation (a generation prompt), so a training rendering has none; the prefix has it
    MISTRAL: "<s>[INST]hi[/INST]«yo!</s>»[INST]bye[/INST]«ciao</s>»",
    PHI: "<|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n«yo!<|end|>»\n<|user|>\nbye<|end|>\n"
    "<|assistant|>\n«ciao<|end|>»\n<|endoftext|>",
    DEEPSEEK: "<｜begin▁of▁sentence｜>be brief<｜User｜>hi<｜Assistant｜>«yo!<｜end▁of▁sentence｜>»"
    "<｜User｜>bye<｜Assistant｜>«ciao<｜end▁of▁sentence｜>»",
}
TRAINED_CHAT = {
    LLAMA: ["yo!<|eot_id|>", "ciao<|eot_id|>"],
    QWEN25: ["yo!<|im_end|>", "ciao<|im_end|>"],
    QWEN3: ["yo!<|im_end|>", "<think>\n\n</think>\n\nciao<|im_end|>"],
    GEMMA: ["yo!<end_of_turn>", "ciao<end_of_turn>"],
    MISTRAL: ["yo!</s>", "ciao</s>"],
    PHI: ["yo!<|end|>", "ciao<|end|>"],
    DEEPSEEK: ["yo!<｜end▁of▁sentence｜>", "ciao<｜end▁of▁sentence｜>"],
}


@functools.cache
def model_tokenizer(name):
    """The byte tokenizer with model ``name``'s special tokens, bos / eos and chat template."""
    bos, eos, others = MODELS[name]
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": others, "eos_token": eos, "bos_token": bos or "<|bos|>"})
    if bos is None:
        tokenizer.bos_token = None
    tokenizer.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


def encode(messages, name, **columns):
    """(document, tokenizer) of a chat example through the data path; checks that the document
    is the template's own rendering, with only the bos / eos the encoder adds around it."""
    tokenizer = model_tokenizer(name)
    example = columns or {"messages": messages}
    document = tokenize_example(example, tokenizer)
    rendering = tokenizer.apply_chat_template(messages, tokenize=False)
    text = tokenizer.decode(document[0])
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token
    expected = ("" if rendering.startswith(bos) else bos) + rendering + ("" if rendering.endswith(eos) else eos)
    assert text == expected
    assert "".join(piece for piece, _ in chat_segments(messages, tokenizer)) == rendering
    return document, tokenizer


def runs(document, tokenizer):
    """The document's (text, trained) runs of tokens."""
    pieces, current, trained = [], [], None
    for token, mask in zip(*document):
        if mask != trained and current:
            pieces.append((tokenizer.decode(current), trained))
            current = []
        current.append(token)
        trained = mask
    return pieces + ([(tokenizer.decode(current), trained)] if current else [])


def trained(document, tokenizer):
    return [text for text, mask in runs(document, tokenizer) if mask]


def marked(document, tokenizer):
    return "".join(f"«{text}»" if mask else text for text, mask in runs(document, tokenizer))


# ----------------------------------------------------------------------------- every template


@pytest.mark.parametrize("name", list(MODELS))
def test_multi_turn_trains_each_assistant_turn_through_its_end_of_turn_token(name):
    messages = CHAT[1:] if name == GEMMA else CHAT
    document, tokenizer = encode(messages, name)
    assert trained(document, tokenizer) == TRAINED_CHAT[name]
    assert marked(document, tokenizer) == MARKED_CHAT[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_assistant_text_that_a_user_message_also_holds_is_found_in_the_assistant_turn(name):
    messages = [{"role": "user", "content": "Repeat: ok"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"}]
    document, tokenizer = encode(messages, name)
    end = {LLAMA: "<|eot_id|>", QWEN25: "<|im_end|>", QWEN3: "<|im_end|>", GEMMA: "<end_of_turn>", MISTRAL: "</s>",
           PHI: "<|end|>", DEEPSEEK: "<｜end▁of▁sentence｜>"}[name]
    user_turn = {LLAMA: f"<|start_header_id|>user<|end_header_id|>\n\nok{end}<|start_header_id|>assistant",
                 QWEN25: f"<|im_start|>user\nok{end}\n<|im_start|>assistant", QWEN3: f"<|im_start|>user\nok{end}\n",
                 GEMMA: f"<start_of_turn>user\nok{end}\n", MISTRAL: "[INST]ok[/INST]", PHI: f"<|user|>\nok{end}\n",
                 DEEPSEEK: "<｜User｜>ok<｜Assistant｜>"}[name]
    text = marked(document, tokenizer)
    assert f"«ok{end}»" in text and user_turn in text  # the user's "ok" stays prompt
    assert trained(document, tokenizer)[0] == f"ok{end}"


@pytest.mark.parametrize("name", [LLAMA, QWEN3, MISTRAL, PHI])
def test_assistant_turns_before_first_trained_are_prompt(name):
    """TRL's conversational prompt-completion: the prompt may hold assistant turns, untrained."""
    prompt, completion = CHAT[:4], CHAT[4:]
    document, tokenizer = encode(CHAT, name, prompt=prompt, completion=completion)
    assert trained(document, tokenizer) == TRAINED_CHAT[name][1:]
    segments = chat_segments(CHAT, model_tokenizer(name), first_trained=4)
    assert [text for text, is_trained in segments if is_trained] == TRAINED_CHAT[name][1:]
    assert "".join(text for text, _ in segments) == model_tokenizer(name).apply_chat_template(CHAT, tokenize=False)
    assert chat_segments(CHAT, model_tokenizer(name), first_trained=5) == [("".join(t for t, _ in segments), False)]


# ----------------------------------------------------------------------------- reasoning (think blocks)


def test_qwen3_keeps_only_the_last_turns_reasoning_and_trains_it():
    """Qwen3 renders the think block only after the last user message: an earlier turn loses
    its reasoning (so the prefix renderings are not prefixes of the whole one)."""
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nsay yo\n</think>\n\nyo!"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "<think>\nsay ciao\n</think>\n\nciao"},
    ]
    document, tokenizer = encode(messages, QWEN3)
    assert trained(document, tokenizer) == ["yo!<|im_end|>", "<think>\nsay ciao\n</think>\n\nciao<|im_end|>"]
    assert marked(document, tokenizer) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        "«yo!<|im_end|>»\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
        "«<think>\nsay ciao\n</think>\n\nciao<|im_end|>»\n<|im_end|>"
    )


def test_qwen3_reasoning_content_and_unnormalized_think_tags():
    """reasoning_content is passed through to the template; think tags written without the
    template's newlines are re-rendered by it; an answer that also occurs in the reasoning
    is found after the think block."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>say yo</think>yo!"},
        {"role": "user", "content": "ciao"},
        {"role": "assistant", "content": "ciao", "reasoning_content": "they said ciao: ciao back"},
    ]
    document, tokenizer = encode(messages, QWEN3)
    assert marked(document, tokenizer) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n«yo!<|im_end|>»\n<|im_start|>user\nciao<|im_end|>\n"
        "<|im_start|>assistant\n«<think>\nthey said ciao: ciao back\n</think>\n\nciao<|im_end|>»\n<|im_end|>"
    )


def test_qwen3_without_think_blocks():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]
    document, tokenizer = encode(messages, QWEN3)
    assert trained(document, tokenizer) == ["yo!<|im_end|>", "<think>\n\n</think>\n\nciao<|im_end|>"]


def test_deepseek_r1_generation_prompt_opens_a_think_block_the_rendered_turns_lack():
    """R1's generation prompt is ``<｜Assistant｜><think>\\n``; its rendered turns drop the
    reasoning and start with the answer right after ``<｜Assistant｜>``."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nsay yo\n</think>\n\nyo!"},
                {"role": "user", "content": "bye"}, {"role": "assistant", "content": "<think>say ciao</think>ciao"}]
    document, tokenizer = encode(messages, DEEPSEEK)
    # R1 keeps what follows </think> as it is, newlines included; they are the turn's, so trained
    assert marked(document, tokenizer) == (
        "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>«\n\nyo!<｜end▁of▁sentence｜>»"
        "<｜User｜>bye<｜Assistant｜>«ciao<｜end▁of▁sentence｜>»"
    )


# ----------------------------------------------------------------------------- other shapes


def test_tool_call_turns_are_trained_through_their_end_of_turn_token():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    document, tokenizer = encode(messages, QWEN25)
    assert trained(document, tokenizer) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        "Sunny.<|im_end|>",
    ]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("name", [QWEN3, LLAMA, MISTRAL])
def test_a_rows_tools_are_written_by_the_template_into_the_prompt(name):
    """Note [A row's tools]: the 'tools' column goes to the template as at inference (the document is
    its rendering with tools=), the definitions land in the untrained prompt, the turns trained are
    the ones trained without tools; a JSON string of the list is the same row."""
    messages = [
        {"role": "user", "content": "weather in Rome?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call00001", "type": "function",  # Mistral's template wants 9-character ids
                         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    tokenizer = model_tokenizer(name)
    document = tokenize_example({"messages": messages, "tools": [WEATHER_TOOL]}, tokenizer)
    rendering = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
    assert rendering != tokenizer.apply_chat_template(messages, tokenize=False)
    text = tokenizer.decode(document[0])
    assert text.endswith(rendering) or text.endswith(rendering + tokenizer.eos_token), (text, rendering)
    prompt = "".join(piece for piece, mask in runs(document, tokenizer) if not mask)
    assert "The weather in a city now" in prompt, prompt
    without = tokenize_example({"messages": messages}, model_tokenizer(name))
    assert trained(document, tokenizer) == trained(without, tokenizer)
    call, answer = trained(document, tokenizer)  # the call is the model's to write, arguments and closing token too
    assert '"city": "Rome"' in call and call.endswith(tokenizer.eos_token if name == MISTRAL else
                                                       {QWEN3: "<|im_end|>", LLAMA: "<|eot_id|>"}[name]), call
    assert answer.endswith("Sunny." + {QWEN3: "<|im_end|>", LLAMA: "<|eot_id|>", MISTRAL: "</s>"}[name]), answer
    assert tokenize_example({"messages": messages, "tools": json.dumps([WEATHER_TOOL])}, tokenizer) == document
    assert tokenize_example({"messages": messages, "tools": None}, tokenizer) == without


@pytest.mark.parametrize("name", [PHI, GEMMA])
def test_tool_calls_a_template_does_not_write_leave_the_turns_as_without_them(name):
    """A template that writes no tool calls: the turn closes at its end-of-turn token as without the
    calls, also when a later message names the called function (the call's name is looked for in
    its own turn only)."""
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "user", "content": "get_weather says sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    document, tokenizer = encode(messages, name)
    plain = [{key: value for key, value in message.items() if key != "tool_calls"} for message in messages]
    end = {PHI: "<|end|>", GEMMA: "<end_of_turn>"}[name]
    assert trained(document, tokenizer) == trained(encode(plain, name)[0], tokenizer) == [
        f"let me look{end}", f"Sunny.{end}"]


def test_tools_a_template_does_not_write_are_refused_and_bad_tools_name_the_row():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ValueError, match=r"^the rows have tools \(a 'tools' column\) and the chat template writes "
                                         r"none of them, .* pass --chat_template FILE"):
        tokenize_example({"messages": messages, "tools": [WEATHER_TOOL]}, model_tokenizer(PHI))
    for tools, message in (("[{", "its 'tools' is a string and not JSON"),
                           ({"name": "f"}, "its 'tools' must be a list of tool definitions")):
        with pytest.raises(ChatRenderError, match=message):
            tokenize_example({"messages": messages, "tools": tools}, model_tokenizer(QWEN3))


@pytest.mark.parametrize("name", [QWEN25, PHI])
def test_two_assistant_turns_in_a_row_with_the_same_text(name):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                {"role": "assistant", "content": "hello there"}]
    document, tokenizer = encode(messages, name)
    assert marked(document, tokenizer) == {
        QWEN25: "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n«hello there<|im_end|>»\n"
        "<|im_start|>assistant\n«hello there<|im_end|>»\n<|im_end|>",
        PHI: "<|user|>\nhi<|end|>\n<|assistant|>\n«hello there<|end|>»\n<|assistant|>\n«hello there<|end|>»\n<|endoftext|>",
    }[name]


def test_a_prefix_the_template_cannot_render_does_not_stop_the_conversation():
    """The first message is the assistant's: the empty prefix before it renders to nothing
    (transformers refuses it), so its header is the one of the conversation's other turn."""
    messages = [{"role": "assistant", "content": "How can I help?"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo!"}]
    document, tokenizer = encode(messages, QWEN25)
    assert marked(document, tokenizer) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>assistant\n«How can I help?<|im_end|>»\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n«yo!<|im_end|>»\n<|im_end|>"
    )
    tokenizer = byte_tokenizer()  # a template that renders only whole conversations: no header is known
    tokenizer.chat_template = (
        "{% if messages[-1]['role'] != 'assistant' %}{{ raise_exception('ends with the assistant') }}{% endif %}"
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>{% endfor %}"
    )
    segments = chat_segments(messages, tokenizer)
    assert [text for text, is_trained in segments if is_trained] == ["How can I help?<|eos|>", "yo!<|eos|>"]


# ----------------------------------------------------------------------------- refusals


def test_conversations_the_template_cannot_render_raise_chat_render_error():
    gemma = model_tokenizer(GEMMA)
    with pytest.raises(ChatRenderError, match="cannot render this conversation: it says System role not supported"):
        tokenize_example({"messages": CHAT}, gemma)
    with pytest.raises(ChatRenderError, match="it says Conversation roles must alternate user/assistant"):
        tokenize_example({"messages": [CHAT[1], CHAT[1]]}, gemma)
    with pytest.raises(ChatRenderError, match=r"chat message 1 must be a \{'role', 'content'\} dict, got 'hi'"):
        tokenize_example({"messages": [CHAT[1], "hi"]}, gemma)
    # Llama 3.1 writes a tool-call turn's call and drops its content: the content is not there
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "let me look", "tool_calls": [call]}]
    with pytest.raises(ChatRenderError) as error:
        tokenize_example({"messages": messages}, model_tokenizer(LLAMA))
    assert str(error.value) == (
        "assistant message 1 (role 'assistant', content 'let me look') is not in the chat template's rendering "
        "where its turn was expected; the rendering there holds "
        + repr('_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Rome"}}'
               "<|eot_id|>")
    )


def test_no_template_is_a_dataset_error_not_a_row_error():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError) as error:
        chat_segments(CHAT, tokenizer)
    assert type(error.value) is ValueError
    assert str(error.value) == (
        "chat (messages) data needs a chat template and the tokenizer has none (base models usually have none): "
        "pass --chat_template FILE, a Jinja chat template such as the instruct model's chat_template.jinja"
    )
