"""llama4_text (Llama4ForCausalLM) under context parallelism against plain single-process transformers
(sdpa, with its chunked masks) on 4 CPU ranks (gloo), with the BASE model, batch, meshes and tolerances
of tests/modules/test_families.py.

What Llama 4 adds, each made to count (``features_change_the_result`` records how far the logits move
without it): layer 0 RoPE with the q/k L2 norm, chunked (attention_chunk_size 6: longer than a zigzag
chunk at cp 4, shorter than a shard at cp 2 and 4; or 20: longer than a shard at cp 2 and 4) and
dense; layer 1 NoPE, full, its queries scaled by their row (floor_scale 3: the temperature changes
every third row, so neighbours differ inside every shard) and routed (sigmoid top-1 of 4) plus shared
experts. Checked: logits, chunked loss and every gradient under ring, Ulysses, all-gather and hybrid,
cp 1, 2 and 4, plain and FSDP, float32 and float64 (the seven runs of test_families_new.py, per chunk
size), packed documents (a row continuing a document from position 3 next to packed rows: transformers
5.24 then counts chunks by position_ids, Note [Chunked attention under CP]), peft's LoRA on q/k/v/o.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from dist_harness import Checks
from document_checks import documents_batch
from fsdp_checks import check_cp_against_reference
from llama_cp.attention.chunks import CHUNKS_BY_POSITION, chunked_layout
from llama_cp.attention.documents import DocumentLayout
from llama_cp.parallel.sharding import document_starts
from test_families import BASE, SEQ_LEN, TOLERANCE, TRANSFORMERS_5, WORLD_SIZE, batch, mesh_for
from test_families_new import RUNS

checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])
SKIP = None if "llama4_text" in CONFIG_MAPPING_NAMES else f"transformers {transformers.__version__} has no llama4_text"
F32, F64 = torch.float32, torch.float64

LLAMA4 = dict(
    BASE, no_rope_layers=[1, 0], attention_chunk_size=6, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, intermediate_size_mlp=64, use_qk_norm=True, attn_temperature_tuning=True,
    floor_scale=3, attn_scale=0.5,
)
CHUNKS = (6, 20)
#: documents of the packed rows: row 0 one document continuing from position 3 (documents_batch), row 1
#: cut across zigzag chunks and chunk edges, with a 1-token document
PACKED_LENGTHS = [[SEQ_LEN], [5, 1, 14, 12]]


def llama4_model(dtype=torch.float32, **overrides):
    config = AutoConfig.for_model("llama4_text", **{**LLAMA4, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(dtype)


def forward_and_loss(model, data):
    out = model(input_ids=data["input_ids"], position_ids=data.get("position_ids"), use_cache=False)
    loss = F.cross_entropy(out.logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    return out.logits, loss


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            init_lora_weights=False))


@functools.cache
def reference(dtype: torch.dtype, chunk: int, packed: bool = False, lora: bool = False):
    """(pristine, reference, data, logits, loss), built once per rank: ``reference`` after its
    forward and backward (the checks read its gradients), ``pristine`` an untouched copy."""
    model = llama4_model(dtype, attention_chunk_size=chunk)
    if lora:
        model = with_lora(model)
    pristine = copy.deepcopy(model)
    data = documents_batch(batch()["input_ids"], PACKED_LENGTHS) if packed else batch()
    logits, loss = forward_and_loss(model, data)
    loss.backward()
    return pristine, model, data, logits.detach(), loss.detach()


def check(strategy: str, cp: int, sharded: bool, dtype: torch.dtype, chunk: int, packed: bool = False,
          lora: bool = False):
    pristine, model, data, logits, loss = reference(dtype, chunk, packed, lora)
    check_cp_against_reference(copy.deepcopy(pristine), model, data, logits, loss, mesh_for(cp), strategy=strategy,
                               sharded=sharded, tol=TOLERANCE[dtype], max_seq_len=SEQ_LEN,
                               ulysses_degree=2 if strategy == "hybrid" else 0)


for _chunk in CHUNKS:
    for _strategy, _cp, _sharded, _dtype in RUNS:
        checks.add(functools.partial(check, _strategy, _cp, _sharded, _dtype, _chunk),
                   name=f"chunk{_chunk}_{_strategy}_cp{_cp}_{'fsdp' if _sharded else 'plain'}_{str(_dtype)[6:]}",
                   skip=SKIP, group=None if _sharded else _cp)
# packed rows plain: with FSDP a dp rank would hold row 0 alone, a call without packed rows, whose
# chunks transformers 5.24 counts by row, where the whole batch's call counts them by position
for _strategy, _cp, _dtype in (("ring", 4, F64), ("allgather", 2, F32), ("hybrid", 4, F32)):
    checks.add(functools.partial(check, _strategy, _cp, False, _dtype, 6, packed=True),
               name=f"chunk6_{_strategy}_cp{_cp}_plain_{str(_dtype)[6:]}_packed", skip=SKIP, group=_cp)
checks.add(functools.partial(check, "ulysses", 2, False, F64, 6, lora=True),
           name="chunk6_lora_ulysses_cp2_plain_float64", skip=SKIP, group=2)


@functools.partial(checks.add, group=1, skip=SKIP)
def features_change_the_result():
    """Each feature moves the logits by more than 1e-3 when switched off: the chunks (a chunk as long
    as the sequence), the query temperature, the q/k norm, the NoPE layer (RoPE on it), the shared
    expert; and, transformers 5.24, counting a packed call's chunks by position_ids (row 0 alone, a
    call without packed rows, counts them by row)."""
    ids = batch()["input_ids"]
    with torch.no_grad():
        on = llama4_model()(input_ids=ids).logits
        off = {
            "chunks": llama4_model(attention_chunk_size=SEQ_LEN),
            "temperature": llama4_model(attn_temperature_tuning=False),
            "q/k norm": llama4_model(use_qk_norm=False),
            "NoPE layer": llama4_model(no_rope_layers=[1, 1], layer_types=["chunked_attention", "full_attention"]),
            "shared expert": llama4_model(),
        }
        off["shared expert"].model.layers[1].feed_forward.shared_expert.down_proj.weight.zero_()
        moved = {name: float((model(input_ids=ids).logits - on).abs().max()) for name, model in off.items()}
        if CHUNKS_BY_POSITION:
            data = documents_batch(ids, PACKED_LENGTHS)
            packed = llama4_model()(input_ids=ids, position_ids=data["position_ids"], use_cache=False).logits
            alone = llama4_model()(input_ids=ids[:1], position_ids=data["position_ids"][:1], use_cache=False).logits
            moved["chunks by position in a packed call"] = float((packed[:1] - alone).abs().max())
    assert min(moved.values()) > 1e-3, moved


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


def transformers_chunked_mask(config, position_ids: torch.Tensor) -> torch.Tensor:
    """(B, L, L) transformers' own chunked causal mask of a call with ``position_ids`` (sdpa, no cache)."""
    from transformers.masking_utils import create_chunked_causal_mask

    rows, length = position_ids.shape
    embeds = torch.zeros(rows, length, 8)
    if TRANSFORMERS_5:
        mask = create_chunked_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
                                          position_ids=position_ids)
    else:
        mask = create_chunked_causal_mask(config=config, input_embeds=embeds, attention_mask=None,
                                          cache_position=torch.arange(length), past_key_values=None,
                                          position_ids=position_ids)
    return mask[:, 0]


@pytest.mark.parametrize("lengths", [[[40]], [[40], [9, 1, 17, 13]], [[23, 17], [40]]])
def test_chunks_are_transformers_chunked_mask(lengths):
    """chunked_layout's documents are exactly transformers' chunked mask (Note [Chunked attention under
    CP]): query t sees key s iff chunk_start[t] <= s <= t, for a call of one-document rows (one
    continuing a document from position 3), and calls with packed rows."""
    if SKIP:
        pytest.skip(SKIP)
    config = AutoConfig.for_model("llama4_text", **{**LLAMA4, "attention_chunk_size": 7})
    ids = torch.zeros(len(lengths), 40, dtype=torch.long)
    positions = documents_batch(ids, lengths)["position_ids"]
    starts = document_starts(positions)
    layout = chunked_layout(DocumentLayout(starts, positions=positions), 7)
    rows = torch.arange(40)
    ours = (layout.starts[:, :, None] <= rows[None, None, :]) & (rows[None, None, :] <= rows[None, :, None])
    assert torch.equal(ours, transformers_chunked_mask(config, positions))


def test_query_temperature_is_taken_from_the_nope_layers_only():
    """apply_context_parallel moves the NoPE layer's temperature to cp_attention_forward (Note [Query
    temperature under CP]); the RoPE layer, which transformers does not scale, keeps none."""
    from llama_cp import apply_context_parallel

    if SKIP:
        pytest.skip(SKIP)
    layers = apply_context_parallel(llama4_model(), None).model.layers
    assert getattr(layers[0].self_attn, "cp_temperature", None) is None
    assert layers[1].self_attn.cp_temperature == (3, 0.5) and not layers[1].self_attn.attn_temperature_tuning


def test_without_position_ids_at_cp1():
    """A call without position_ids (cp 1: the decoder's hook makes no layouts) of an odd length still
    chunks its layers (by row, as transformers does) and scales its NoPE layer's queries by row."""
    from llama_cp import apply_context_parallel

    if SKIP:
        pytest.skip(SKIP)
    ids = batch()["input_ids"][:, :31]
    with torch.no_grad():
        want = llama4_model(F64)(input_ids=ids).logits
        got = apply_context_parallel(llama4_model(F64), None, document_mask=False)(input_ids=ids).logits
    torch.testing.assert_close(got, want, **TOLERANCE[F64])


def test_the_vision_language_llama4_is_refused_its_text_model_not():
    """Llama4ForCausalLM of a llama4 config's text_config (llama4_text; transformers 5's
    AutoModelForCausalLM builds it from the llama4 config itself) is supported;
    Llama4ForConditionalGeneration (llama4) given as a model is refused in one line pointing to it (a
    checkpoint directory of it is read as its text model: tests/modules/test_checkpoints.py)."""
    from transformers import Llama4ForConditionalGeneration

    from llama_cp import apply_context_parallel

    if SKIP:
        pytest.skip(SKIP)
    text = {k: v for k, v in LLAMA4.items() if k != "attn_implementation"}
    config = AutoConfig.for_model("llama4", text_config=text, vision_config=dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32))
    with torch.device("meta"):
        text_model = AutoModelForCausalLM.from_config(config if TRANSFORMERS_5 else config.get_text_config())
        model = Llama4ForConditionalGeneration(config)
    apply_context_parallel(text_model, None)
    with pytest.raises(ValueError, match=r"^model family 'llama4' \(Llama4ForConditionalGeneration\) is not supported "
                                         r"by llama-cp: it is the vision-language .* its text model, Llama4ForCausalLM "
                                         r"\(llama4_text\): give the recipe the checkpoint directory, .*language_model\. "
                                         r"Supported"):
        apply_context_parallel(model, None)


def test_no_router_loss_as_in_transformers():
    """Llama4ForCausalLM's forward adds no router loss, whatever output_router_logits says: neither does
    llama-cp, and --router_aux_loss_coef is refused in one line."""
    from llama_cp.modules.families import router_loss, set_router_loss_coef

    if SKIP:
        pytest.skip(SKIP)
    model = llama4_model(output_router_logits=True, router_aux_loss_coef=0.3)
    assert router_loss(model) is None
    with pytest.raises(ValueError, match=r"^--router_aux_loss_coef 0.1: 'llama4_text' adds no router load-balancing "
                                         r"loss \(families that do: .*\); drop the flag$"):
        set_router_loss_coef(model.config, 0.1)
