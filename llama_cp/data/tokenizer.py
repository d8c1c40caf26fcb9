"""The embedded byte-level tokenizer: one token per UTF-8 byte, built locally, no download.

Token ids 0..255 are the bytes themselves (id == byte value), then three
special tokens::

    256 <|pad|>    257 <|bos|>    258 <|eos|>

The vocabulary (259) fits the embedded model's 1024 embeddings. Bytes are
spelled with GPT-2's printable byte alphabet (the ``ByteLevel`` pre-tokenizer
and decoder of ``tokenizers``) and the BPE model has no merges, so every byte
stays its own token and ``decode(encode(text)) == text`` for any text. Encoding
adds no special tokens (``add_special_tokens`` has nothing to add): the data
code puts bos / eos around each document itself.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"

#: One ``<|bos|>role\ncontent<|eos|>`` block per message; the generation prompt
#: opens an assistant block. Rendering a prefix of a conversation gives a prefix
#: of the full rendering, which is what the data code's assistant masking needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|bos|>' + message['role'] + '\n' + message['content'] + '<|eos|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|bos|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """The printable character GPT-2's byte-level BPE uses for each byte value 0..255.

    Printable Latin-1 bytes stand for themselves; the others (control bytes,
    space, ...) are shifted to code points 256 and up, in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The embedded tokenizer: 256 byte tokens (id == byte value) + pad, bos, eos; 259 tokens in all."""
    alphabet = _byte_alphabet()
    backend = Tokenizer(models.BPE(vocab={char: byte for byte, char in enumerate(alphabet)}, merges=[]))
    # no regex split: without merges every byte is a token anyway, and no prefix space keeps the round trip exact
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD_TOKEN, BOS_TOKEN, EOS_TOKEN])  # ids 256, 257, 258
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# Note [A processor's chat template]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A vision-language checkpoint may keep its chat template only in its processor's file,
# chat_template.json ({"chat_template": "..."}, written by transformers' ProcessorMixin), which
# AutoTokenizer does not read (checked with transformers 5.17 and 5.24: no template). llama-cp
# trains such a checkpoint's text model (Note [The text model of a vision-language checkpoint]), and
# that template is the model's own: a tokenizer without one takes it. --chat_template still wins.
PROCESSOR_TEMPLATE = "chat_template.json"


def build_tokenizer(path: str | None, chat_template: str = ""):
    """The tokenizer of the model directory ``path`` (``build.model_path``), the embedded byte
    tokenizer for None; ``chat_template``: a Jinja file whose template replaces the tokenizer's
    (``--chat_template``); without one, a tokenizer with no template takes the processor's (Note [A
    processor's chat template])."""
    from transformers import AutoTokenizer

    from llama_cp.modules.causal_lm import check_tokenizer_files

    if path is None:
        tokenizer = byte_tokenizer()
    else:
        check_tokenizer_files(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        processor_file = os.path.join(path, PROCESSOR_TEMPLATE)
        if not chat_template and not tokenizer.chat_template and os.path.isfile(processor_file):
            with open(processor_file) as f:
                template = json.load(f).get("chat_template")
            if isinstance(template, str):
                tokenizer.chat_template = template
    if chat_template:
        with open(os.path.expanduser(chat_template)) as f:
            tokenizer.chat_template = f.read()
    return tokenizer
