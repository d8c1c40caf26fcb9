"""Gemma 3n's text model (gemma3n_text, Gemma3nForCausalLM; its gemma3n vision-language checkpoints are read as
it) under context parallelism against plain single-process transformers on 4 CPU ranks (gloo), with the BASE
model, batch, meshes and tolerances of tests/modules/test_families.py and the runs of test_families_new.py.

What Gemma 3n adds, each made to count (``features_change_the_result`` records how far the logits move
without it): four layers (windowed, full, windowed, full), the last two reusing the first two's keys and values
(as Gemma 4's); AltUp's four copies of the hidden state, predicted before each layer and corrected after it, its
prediction coefficients clamped in place to +-altup_coef_clip in training (here 0.05, two coefficients of each
layer at +-2: the clamp acts); LAuReL's low-rank residual; per-layer inputs (their own embedding of the tokens,
gated by the corrected output); each layer's own MLP size and a Gaussian top-k on the first two layers' MLP
activations; the logit soft-cap. Checked: logits, chunked loss and every gradient under ring, Ulysses,
all-gather and hybrid, cp 1, 2 and 4, plain and FSDP, float32 and float64 (its RMSNorm computes in float32:
float64 agrees to float32 precision), each layer checkpointed as the trainer does it, packed documents, peft's
LoRA (plain and under FSDP); after each run's forward, every parameter (each rank's shard) against the
reference's, whose coefficients transformers clamped (Note [AltUp's clamp under FSDP2]); FSDP2 computing in
bfloat16, as on a GPU; the AltUp layers kept out of 4-bit quantization.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from dist_harness import Checks
from document_checks import documents_alone, documents_batch
from fsdp_checks import check_cp_against_reference
from llama_cp.modules.families import transformers_refusal
from test_families import BASE, SEQ_LEN, TOLERANCE, WINDOW, WORLD_SIZE, batch, mesh_for
from test_families_new import NO_WINDOWS, RUNS, _zero

checks = Checks(setup=lambda sizes: [mesh_for(cp) for cp in sorted(sizes)])
F32, F64 = torch.float32, torch.float64
TOL = TOLERANCE[F32]  # float32 RMSNorm: the module docstring

#: four layers of their own MLP sizes, the last two reusing the first two's keys and values; per-layer inputs
#: embedded from a table of 64 of the 96 tokens (transformers maps the others to token 0); the clamp at 0.05,
#: a little beyond the coefficients' spread (initializer_range 0.02), and not a float32 number
GEMMA3N = dict(BASE, num_hidden_layers=4, intermediate_size=[64, 48, 64, 32],
               layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW, num_kv_shared_layers=2,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, laurel_rank=4,
               activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], altup_coef_clip=0.05,
               final_logit_softcapping=1.0)
PACKED_LENGTHS = [[5, 1, 14, 12], [9, 23]]


def skip_reason() -> str | None:
    if "gemma3n_text" not in CONFIG_MAPPING_NAMES:
        return f"transformers {transformers.__version__} has no 'gemma3n_text'"
    return transformers_refusal("gemma3n_text", transformers.__version__)


SKIP = skip_reason()


def gemma3n_model(dtype=F32, **overrides):
    """The model in ``dtype``, AltUp's output scales set to 0.5-1.5 (zeros at init: the per-layer inputs would
    add nothing) and the prediction coefficients beyond the clamp at two places of each layer."""
    config = AutoConfig.for_model("gemma3n_text", **{**GEMMA3N, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("altup.correct_output_scale"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator, dtype=tensor.dtype))
            if name.endswith("altup.prediction_coefs.weight"):
                tensor[0, 0], tensor[-1, -1] = 2.0, -2.0
    return model


def _weights_of(source):
    """A change of a built model: the parameters ``source`` also has set to its (the layers that compute their own
    keys and values keep their k/v projections' random weights, the rest is ``source``'s)."""
    def change(model):
        missing = model.load_state_dict(source.state_dict(), strict=False).missing_keys
        assert missing and all(".self_attn.k_" in key or ".self_attn.v_" in key for key in missing), missing
    return change


def forward_and_loss(model, data):
    logits = model(input_ids=data["input_ids"], position_ids=data.get("position_ids"), use_cache=False).logits
    return logits, F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "laurel.linear_left"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets))


@functools.cache
def reference(dtype: torch.dtype, packed: bool = False, lora: bool = False, checkpointed: bool = False):
    """(pristine, reference, data, logits, loss), built once per rank: ``reference`` after its forward and
    backward (the checks read its gradients), ``pristine`` an untouched copy (its coefficients not clamped)."""
    model = gemma3n_model(dtype)
    if lora:
        model = with_lora(model)
    pristine = copy.deepcopy(model)
    if checkpointed:
        from llama_cp.fsdp_wrap import apply_activation_checkpointing

        apply_activation_checkpointing(pristine)
        assert all(layer.gradient_checkpointing for layer in pristine.model.layers)
    data = documents_batch(batch()["input_ids"], PACKED_LENGTHS) if packed else batch()
    assert model.training
    logits, loss = forward_and_loss(model, data)
    if not packed and not lora:  # transformers' own loss (labels unshifted: it shifts them)
        hf_labels = torch.cat([torch.full((data["labels"].shape[0], 1), -100), data["labels"][:, :-1]], dim=1)
        torch.testing.assert_close(model(input_ids=data["input_ids"], labels=hf_labels).loss.float(), loss.float(),
                                   **TOL)
    loss.backward()
    return pristine, model, data, logits.detach(), loss.detach()


def check(strategy: str, cp: int, sharded: bool, dtype: torch.dtype, packed: bool = False, lora: bool = False,
          checkpointed: bool = False):
    """The CP run's logits, loss and gradients against transformers', then its parameters against the reference's
    after both forwards: the coefficients transformers clamped in place are clamped in each rank's shard too
    (Note [AltUp's clamp under FSDP2]), so the optimizer steps what single-process transformers would."""
    pristine, reference_model, data, logits, loss = reference(dtype, packed, lora, checkpointed)
    model = copy.deepcopy(pristine)
    check_cp_against_reference(model, reference_model, data, logits, loss, mesh_for(cp), strategy=strategy,
                               sharded=sharded, tol=TOL, max_seq_len=SEQ_LEN,
                               ulysses_degree=2 if strategy == "hybrid" else 0)
    # the reference's coefficients are clamped (transformers did it in place) and every shard equals them: each
    # shard holds the clamp
    clamped = sum(int((pristine.get_parameter(name) != want).sum())
                  for (name, _), want in zip(model.named_parameters(), reference_model.parameters(), strict=True)
                  if "prediction_coefs" in name)
    assert clamped > 0, "transformers clamped no coefficient of the reference: the comparison shows no clamp"
    for (name, param), want in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            param, want = param.to_local(), want[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        torch.testing.assert_close(param.detach(), want.detach(), atol=0, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _add(strategy: str, cp: int, sharded: bool, dtype: torch.dtype, packed: bool = False, lora: bool = False,
         checkpointed: bool = False):
    extras = f"{'_packed' if packed else ''}{'_lora' if lora else ''}{'_checkpointed' if checkpointed else ''}"
    checks.add(functools.partial(check, strategy, cp, sharded, dtype, packed, lora, checkpointed),
               name=f"gemma3n_{strategy}_cp{cp}_{'fsdp' if sharded else 'plain'}_{str(dtype)[6:]}{extras}",
               skip=SKIP, group=None if sharded else cp)


for _run in RUNS:  # every strategy, cp 1, 2 and 4, plain and FSDP, float32 and float64
    _add(*_run)
_add("ring", 2, True, F32, packed=True)
_add("allgather", 4, True, F32, packed=True)
_add("ulysses", 2, False, F64, lora=True)
_add("ring", 2, True, F32, lora=True)  # the trainer's LoRA: peft's model sharded, its frozen coefficients clamped
_add("ring", 2, True, F32, checkpointed=True)


@functools.partial(checks.add, skip=SKIP)
def ring_cp2_fsdp_bfloat16():
    """FSDP2 computing in bfloat16, as every GPU run does: it casts each layer's inputs to bfloat16, and the keys
    and values handed to the reusing layers must still reach them (Note [A family's transformers floor]). Logits,
    loss and gradients against float32 transformers, to bfloat16's precision."""
    pristine, reference_model, data, logits, loss = reference(F32)
    check_cp_against_reference(copy.deepcopy(pristine), reference_model, data, logits, loss, mesh_for(2),
                               strategy="ring", sharded=True, tol=dict(atol=5e-2, rtol=5e-2, check_dtype=False),
                               max_seq_len=SEQ_LEN, param_dtype=torch.bfloat16)


@functools.partial(checks.add, group=1, skip=SKIP)
def features_change_the_result():
    """Each feature moves the logits by more than 1e-3 when switched off (the assertion message lists how
    far), and transformers' packed rows equal each document run alone (the packed checks' reference)."""
    data = documents_batch(batch()["input_ids"], PACKED_LENGTHS)
    ids = data["input_ids"]
    moved = {}
    with torch.no_grad():
        whole = gemma3n_model()(input_ids=ids).logits
        for feature, overrides, change in (
            ("windows", NO_WINDOWS, None),
            ("logit soft-cap", dict(final_logit_softcapping=1e6), None),  # its config takes no None
            ("keys and values reused", dict(num_kv_shared_layers=0), _weights_of(gemma3n_model())),
            ("AltUp coefficient clamp", dict(altup_coef_clip=120.0), None),  # the released configs' clamp
            ("AltUp corrected output scale", dict(altup_correct_scale=False), None),
            ("LAuReL", {}, _zero("laurel.linear_right.weight")),
            ("per-layer inputs", {}, _zero("per_layer_projection.weight")),
            ("Gaussian top-k activations", dict(activation_sparsity_pattern=[0.0] * 4), None),
        ):
            off = gemma3n_model(**overrides)
            if change is not None:
                change(off)
            moved[feature] = float((whole - off(input_ids=ids).logits).abs().max())
        model = gemma3n_model()
        packed = forward_and_loss(model, data)[0]
        torch.testing.assert_close(packed, documents_alone(model, data, PACKED_LENGTHS), **TOL)
        moved["documents"] = float((packed - model(input_ids=ids).logits).abs().max())
    assert min(moved.values()) > 1e-3, moved


results = checks.module_fixture(__name__, WORLD_SIZE)


@pytest.mark.parametrize("name", checks.names)
def test_check(results, name):
    checks.assert_passed(results, name)


def test_test_model_holds_the_features_it_is_checked_for():
    """The layers that reuse keys and values hold no k/v projections, each layer its own MLP size, the first two
    the Gaussian top-k; the clamp acts on each layer's coefficients."""
    if SKIP:
        pytest.skip(SKIP)
    model = gemma3n_model()
    layers = model.model.layers
    assert [hasattr(layer.self_attn, "k_proj") for layer in layers] == [True, True, False, False]
    assert [layer.mlp.intermediate_size for layer in layers] == [64, 48, 64, 32]
    assert [layer.mlp.activation_sparsity for layer in layers] == [0.95, 0.95, 0.0, 0.0]
    assert all(float(layer.altup.prediction_coefs.weight.abs().max()) > 0.05 for layer in layers)
    model(input_ids=batch()["input_ids"])
    assert all(float(layer.altup.prediction_coefs.weight.abs().max()) == pytest.approx(0.05) for layer in layers)


@pytest.mark.parametrize("clip", [0.05, 0.02, 120.0])
def test_the_coefficients_clamped_in_place_are_read_from_transformers(clip):
    """_clamped_in_place names the coefficients the installed AltUp clamps in place: the prediction ones (5.24
    clamps the correction ones functionally), whatever the clamp's rounding in float32 (0.05 rounds up, 0.02
    down). The first version compared the clamped values with the clamp and found none at 0.05: a run of the
    trainer kept coefficients of 2.0 under a clamp of 0.05."""
    from llama_cp.modules.altup import _clamped_in_place

    if SKIP:
        pytest.skip(SKIP)
    altup = gemma3n_model(altup_coef_clip=clip).model.layers[0].altup
    assert _clamped_in_place(altup) == ("prediction_coefs",)


def test_releases_whose_reusing_layers_miss_the_shared_keys_are_refused():
    """Up to 5.5.4 transformers' Gemma 3n reused keys and values only from a cache (none without one: its reusing
    layers trained k/v projections inference does not run), and up to 5.8 it handed them on in a dict that
    FSDP2 copies on the way into a layer (with the dict swapped back in, every FSDP check here fails with a
    KeyError). Refused there in one line, Gemma 4 too (Note [A family's transformers floor])."""
    for family in ("gemma3n_text", "gemma4_text"):
        assert transformers_refusal(family, "5.8.0") == (
            f"model family '{family}' needs transformers >= 5.9 (installed: 5.8.0): before that its layers that "
            "reuse an earlier layer's keys and values computed their own without a cache, from k/v projections its "
            "inference does not run (to 5.5), then got them in a dict that FSDP2 copies on the way into a layer, so "
            "they found none (to 5.8); upgrade transformers")
        assert transformers_refusal(family, "5.9.0") is None


def test_altup_layers_stay_out_of_4bit_quantization():
    """--quantization 4bit keeps AltUp's layers in full precision: transformers clamps their weights in place and
    multiplies by a clamped copy, which 4-bit codes cannot take (RuntimeError: result type Float can't be cast to
    the desired output type unsigned char); the rest of each layer is quantized, and a training forward runs."""
    from llama_cp.modules.quantize import NF4Linear, installed_qlora_refusal, quantize_model

    if SKIP or installed_qlora_refusal():
        pytest.skip(SKIP or installed_qlora_refusal())
    model = quantize_model(gemma3n_model())
    layer = model.model.layers[0]
    altup = [m for m in layer.altup.modules() if isinstance(m, (torch.nn.Linear, NF4Linear))]
    assert len(altup) == 3 and not any(isinstance(m, NF4Linear) for m in altup)  # router, both coefficients
    assert isinstance(layer.self_attn.q_proj, NF4Linear) and isinstance(layer.laurel.linear_left, NF4Linear)
    assert model.train()(input_ids=batch()["input_ids"]).logits.isfinite().all()
