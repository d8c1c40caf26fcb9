"""Model FLOPs of a training step, the device's peak, and the throughput figures of a metrics row.

    flops = model_flops(config, lora_r=8, lora_targets=("q_proj", "v_proj"))
    step = flops.step(tokens=8192, pairs=attention_pairs(position_ids))
    row = throughput(tokens=8192, flops=step, seconds=1.3, world_size=1, peak=peak_flops("NVIDIA H100 80GB HBM3"))

Note [Model FLOPs]
==================

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) divides the
FLOPs the *model* needs for a step by what the devices could do in the step's time.
"Needs" is a convention, and ours is:

- Matrix multiplications only, 2 FLOPs per multiply-add. Norms, RoPE, activations,
  softmax and the loss are left out (a few percent at most). The embedding is a
  lookup, not a matmul: 0 FLOPs. The output head (lm_head) is counted, tied or not.
- Per token and decoder layer, the linear layers: q_proj (hidden -> heads x head_dim),
  k_proj and v_proj (hidden -> kv_heads x head_dim, so GQA's smaller K/V count as
  they are), o_proj, and the MLP's gate, up and down projections.
- Forward and backward of a trained weight: 3 x forward (the backward computes the
  input's gradient and the weight's, each as large as the forward). A frozen weight
  (the base of LoRA, QLoRA's NF4 weights) needs no weight gradient: 2 x forward. The
  LoRA adapters A (in -> r) and B (r -> out) are trained: 3 x. With LoRA we count the
  input gradient of every frozen layer, as if the embedding's output needed one; in
  the first layer autograd may skip some of that (nothing before it trains), at most
  a share of 1 / num_layers of the backward, which we do not chase.
- LoRA's ``all-linear`` adapts every Linear layer but the output layer, as peft picks
  them (the model is built on the meta device to find them). A Linear layer in
  --lora_modules_to_save (lm_head, or one inside a module named there) is trained in
  full beside its frozen original, which is then not run: 3 x forward. A copied
  embedding or norm adds nothing (a lookup, elementwise). DoRA's weight norms are work
  per micro-batch, not per token (an r-rank product and a norm of each adapted weight,
  about what its adapters cost on in_features tokens): left out, below 0.1% of a step
  of 8K tokens per micro-batch at r <= 8.
- Attention: per (query, key) pair and query head, q.k and p.v are 2 x head_dim
  multiply-adds, 4 x head_dim FLOPs forward, and the backward's four products (dP,
  dV, dQ, dK) twice that: 12 x head_dim x heads x layers per pair. DeepSeek's multi-head
  latent attention: q.k, dQ and dK at the query/key head size (qk_nope + qk_rope), p.v, dP and
  dV at v_head_dim, 6 x (qk + v) x heads x layers; its low-rank projections (q_a/q_b_proj,
  kv_a_proj_with_mqa, kv_b_proj) are linear layers as above. The zeros llama-cp pads the values
  with (Note [Value heads narrower than keys] in llama_cp/cp_attention.py) are not model work. Counted are the
  pairs attention really computes: a causal row of L tokens L(L+1)/2 (query t sees
  keys 0..t), packed documents of lengths d_i sum d_i(d_i+1)/2 (each sees only
  itself; ``DocumentLayout.visible_pairs``, Note [Document masks under CP] in
  llama_cp/attention/documents.py), the whole row when --document_mask is off.
- Sliding windows: a query of a windowed layer sees at most the window's keys, so
  the pairs are counted per layer and averaged over the layers (``ModelFlops.pairs``). Where the
  layers' heads differ (Gemma 4's full layers: their own head size and key/value heads, read
  per layer from transformers' per-layer config), each layer's pairs weigh by its own FLOPs
  per pair (``ModelFlops.pair_shares``), and its linear layers take its own sizes. Gemma 4's
  layers that reuse an earlier layer's keys and values have no k/v projections, its full
  layers with ``attention_k_eq_v`` no v projection; its per-layer inputs add a projection of
  the embeddings once per token and a gate and projection back in every layer, its expert block
  (``enable_moe_block``) a router and its top k experts beside the MLP.
- Mixture of experts (Mixtral, Qwen2/3-MoE, OLMoE, GLM-4.5, gpt_oss, DeepSeek-V2/V3): a token
  runs through its top k experts, so an MoE layer's MLP counts k x (gate, up, down) at the expert's
  intermediate size (``moe_intermediate_size`` where the config has one), plus the
  router (hidden -> experts) and a shared expert every token runs (Qwen2-MoE's, with its
  hidden -> 1 gate; GLM-4.5's and DeepSeek's); Qwen2/3-MoE's dense layers (``mlp_only_layers``,
  ``decoder_sparse_step``) and GLM-4.5's and DeepSeek's first ``first_k_dense_replace`` count as
  dense; ERNIE 4.5's every ``moe_layer_interval``-th layer has experts and its shared ones,
  Hunyuan-A13B's every layer its top ``moe_topk`` experts (of ``intermediate_size``, k per
  layer where a list) beside a shared Llama MLP; MiniMax-M2's and dots.llm1's count as above.
  LoRA on the fused experts
  (--lora_target_parameters) is not counted. gpt_oss's experts (fused gate_up_proj) count the same;
  its attention sinks (one more logit per query row and head, Note [Attention sinks under CP]) and its
  experts' biases are no matmul: left out. Llama 4: its ``moe_layers`` have routed experts and an
  ungated shared expert at ``intermediate_size``, its dense layers ``intermediate_size_mlp``;
  transformers 5.24's Llama4TextExperts runs every token through all E experts (one bmm, the
  unchosen ones' inputs scaled to 0), E / k times the routed work: that excess is not model work.
- Llama 4's chunked attention: a query of a chunked layer sees only its chunk's keys (Note
  [Chunked attention under CP] in llama_cp/attention/chunks.py), counted per layer as windows are.
- Recomputation is not model work: activation checkpointing's second forward,
  flash-attention's recomputed scores in its backward, the chunked loss's recomputed
  logits all cost time and count nothing. MFU is therefore below the hardware's
  utilisation (HFU) exactly when a run recomputes.

How this compares with the usual figures. PaLM and torchtitan's
``get_num_flop_per_token`` use 6 N + 12 x layers x heads x head_dim x L per token,
N the parameters without the embedding: the same 6 N for a full fine-tune, but
attention over all L^2 (query, key) pairs, where a causal model computes about half.
At long context attention dominates, so the same run shows a higher MFU there: for
Llama-3-8B torchtitan's count is 1.13 x ours at 8192 tokens, 1.70 x at 131072, 1.82 x
at 262144 (its 548 tokens/s/GPU at 256K on H100 are 25% MFU by its count, 14% by ours). We count the causal
half (as FlashAttention's benchmarks do for causal attention) so that packed
documents, whose work is far smaller, are not credited with a full row's. Megatron-LM
(Narayanan et al. 2021, "Efficient large-scale language model training on GPU
clusters") counts 4 x forward per weight because it includes the checkpointing
recompute: that is hardware FLOPs, not model FLOPs.

Per GPU: the step's model FLOPs over all ranks divided by the world size (the
ranks of a cp group share one sequence), over the step's wall time. The peak is
the device's dense bf16 tensor-core rate (``PEAK_BF16_FLOPS``, or --peak_tflops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from llama_cp.model.flops_gemma import gemma3n_layer_flops, gemma4_layer_flops
from llama_cp.modules.layers import attention_head_dim, layer_chunks, layer_configs, layer_windows

#: Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per GPU by the exact name
#: ``torch.cuda.get_device_name()`` reports; a name not here gets no MFU (--peak_tflops sets one).
#: Exact, not by a part of the name: an "H200 NVL" (835 T) is not an "H200" (989 T), and a new
#: part's name containing an old one's must not inherit its peak. NVIDIA's datasheets give the
#: tensor-core rates "with sparsity"; the dense rate is half:
#:
#:   A100 SXM4 and PCIe, 40 and 80 GB   312 T   (624 with sparsity)
#:   H100 SXM                           989 T   (1979)      H100 PCIe   756 T (1513)
#:   H100 NVL                           835 T   (1671)
#:   H200 SXM                           989 T   (1979)      H200 NVL    835 T (1671)
#:   H800 SXM                           989 T   (1979)      H800 PCIe   756 T (1513)
#:   H20                                148 T   (its spec sheet's BF16 figure, dense)
#:   B200 (HGX B200, 1000 W)           2250 T   ("4.5 PFLOPS", 36 per 8-GPU board)
#:   GB200 (GB200 NVL72)               2500 T   ("5 PFLOPS", 360 per 72 GPUs)
#:   L40S                               362 T   (733)
#:   GeForce RTX 4090                   165.2 T (330.4): the Ada whitepaper's "BF16 Tensor TFLOPS
#:                                      with FP32 accumulate", the accumulation training uses; its
#:                                      330 / 660 are FP16 with FP16 accumulate, dense / sparse
#:
#: The names, as far as public code and issues could confirm them: torch's own output (a
#: torch warning, code comparing torch.cuda.get_device_name or get_device_properties().name
#: with it) for "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA H800 PCIe" and
#: "NVIDIA H20"; test fixtures that imitate torch's device properties for "NVIDIA H800" and
#: "NVIDIA GB200"; torch's inductor table keyed by get_device_name for "NVIDIA B200". Not
#: confirmed from torch itself, only as the same driver name in nvidia-smi output and GPU
#: catalogues: "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe",
#: "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA L40S",
#: "NVIDIA GeForce RTX 4090".
PEAK_BF16_FLOPS: dict[str, float] = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA H800": 989e12,  # H800 SXM
    "NVIDIA H800 PCIe": 756e12,
    "NVIDIA H20": 148e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA GB200": 2500e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA GeForce RTX 4090": 165.2e12,
}

#: Per-layer linear layers of the Llama family: name -> (in features, out features) of a config.
_LAYER_LINEARS = {
    "q_proj": lambda c: (c["hidden"], c["heads"] * c["head_dim"]),
    "k_proj": lambda c: (c["hidden"], c["kv_heads"] * c["head_dim"]),
    "v_proj": lambda c: (c["hidden"], c["kv_heads"] * c["head_dim"]),
    "o_proj": lambda c: (c["heads"] * c["head_dim"], c["hidden"]),
    "gate_proj": lambda c: (c["hidden"], c["intermediate"]),
    "up_proj": lambda c: (c["hidden"], c["intermediate"]),
    "down_proj": lambda c: (c["intermediate"], c["hidden"]),
}
#: Fused layers (Phi-3) as LoRA targets: the sum of the layers above they replace; the dense
#: FLOPs are the same either way.
_FUSED_LINEARS = {
    "qkv_proj": lambda c: (c["hidden"], (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"]),
    "gate_up_proj": lambda c: (c["hidden"], 2 * c["intermediate"]),
}


@dataclass(frozen=True)
class ModelFlops:
    """Forward + backward model FLOPs of one model (Note [Model FLOPs])."""

    per_token: float
    """of the linear layers (decoder and lm_head, LoRA adapters included), per token."""
    per_pair: float
    """of attention, per visible (query, key) pair, all layers."""
    windows: tuple[int | None, ...] = ()
    """each layer's sliding window (None: full); empty: no layer has one."""
    chunks: tuple[int | None, ...] = ()
    """each layer's attention chunk (Llama 4; None: none); empty: no layer has one."""
    pair_shares: tuple[float, ...] = ()
    """each layer's share of ``per_pair`` (Gemma 4's full layers have larger heads); empty: equal shares."""
    layer_flops: tuple[float, ...] = ()
    """each decoder layer's share of ``per_token``: its linear layers (dense and MoE layers, Gemma 4's
    layers without k/v projections differ)."""

    def step(self, tokens: int, pairs: float) -> float:
        """Model FLOPs of ``tokens`` tokens whose attention sees ``pairs`` (query, key) pairs
        (per layer, averaged over the layers: :meth:`pairs`)."""
        return self.per_token * tokens + self.per_pair * pairs

    def pairs(self, position_ids: torch.Tensor, document_mask: bool = True) -> float:
        """The visible (query, key) pairs of a batch (:func:`attention_pairs`), averaged over the
        layers, whose sliding windows or attention chunks see fewer."""
        layers = max(len(self.windows), len(self.chunks), len(self.pair_shares), 1)
        kinds = list(zip(self.windows or (None,) * layers, self.chunks or (None,) * layers))
        counts = {kind: attention_pairs(position_ids, document_mask, *kind) for kind in set(kinds)}
        shares = self.pair_shares or (1 / layers,) * layers
        return sum(share * counts[kind] for share, kind in zip(shares, kinds, strict=True))


def model_flops(config: Any, *, lora_r: int = 0, lora_targets: tuple[str, ...] = (),
                modules_to_save: tuple[str, ...] = ()) -> ModelFlops:
    """The :class:`ModelFlops` of an HF Llama-family ``config``; ``lora_r`` > 0: LoRA of rank
    ``lora_r`` on the layers named in ``lora_targets`` (``all-linear``: every Linear layer but
    the output layer), base weights frozen, embedding too, but the Linear layers of
    ``modules_to_save`` (peft's names, matched by the end of a module's name) trained in full."""
    trained: frozenset[str] = frozenset()
    if lora_r:
        lora_targets, trained = _lora_layers(config, lora_targets, modules_to_save)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    weight_passes = 2 if lora_r else 3  # frozen: forward + input gradient; trained: + weight gradient

    def linear(name: str, fan_in: int, fan_out: int, copies: int = 1, adapted: bool = True) -> int:
        """A linear layer's FLOPs per token, run ``copies`` times (an MoE's routed experts), its adapters too
        (``adapted``: the model runs the layer as a module, which peft's adapters wrap)."""
        flops = copies * 2 * (3 if name in trained else weight_passes) * fan_in * fan_out
        if lora_r and adapted and name in lora_targets:
            flops += copies * 2 * 3 * lora_r * (fan_in + fan_out)
        return flops

    mlp_linears = _MLP_LINEARS[1:] if config.model_type in _UNGATED_MLP else _MLP_LINEARS

    def layer_flops(mlp_copies: int, mlp_shape: dict, attention: dict | None, shape: dict) -> int:
        per_layer = sum(linear(name, *features) for name, features in (attention or {}).items())
        per_layer += sum(linear(name, *_LAYER_LINEARS[name](mlp_shape), mlp_copies) for name in mlp_linears)
        for name, features in _FUSED_LINEARS.items():
            if lora_r and name in lora_targets and attention:
                per_layer += 2 * 3 * lora_r * sum(features(shape))
        return per_layer

    layers = config.num_hidden_layers
    decoder, pair_flops = 0, []
    per_layer = []
    for index, layer in enumerate(layer_configs(config)):
        before = decoder
        shape = _shape(layer)
        if getattr(config, "num_attention_heads_per_layer", None):  # Laguna: query heads by layer
            shape["heads"] = config.num_attention_heads_per_layer[index]
        if config.model_type == "mimo_v2_flash" and config.layer_types[index] == "sliding_attention":
            shape["kv_heads"] *= 2  # MiMoV2FlashAttention: twice the key/value heads on its windowed layers
        attention = _attention_linears(layer, shape)
        top_k, experts = _moe(config, index)
        if config.model_type in ("gemma4_text", "gemma4_unified_text"):
            decoder += gemma4_layer_flops(config, index, shape, attention, linear, layer_flops)
        elif config.model_type == "gemma3n_text":
            decoder += gemma3n_layer_flops(config, index, shape, attention, linear, layer_flops)
        elif experts and _is_moe_layer(config, index):
            expert_size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Cohere2-MoE
            expert = {**shape, "intermediate": expert_size}
            decoder += layer_flops(top_k, expert, attention, shape) + 2 * weight_passes * config.hidden_size * experts
            shared, gated = _shared_expert(config)
            if shared:  # every token, beside the routed experts
                decoder += layer_flops(1, {**shape, "intermediate": shared}, None, shape)
                decoder += 2 * weight_passes * config.hidden_size * gated
        else:
            decoder += layer_flops(1, shape, attention, shape)
        per_layer.append(float(decoder - before))
        # q.k at the query/key heads' size, p.v at the values' (DeepSeek's MLA: unlike), each 2 FLOPs a multiply-add
        pair_flops.append(3 * 2 * (attention_head_dim(layer) + _value_head_dim(layer)) * shape["heads"])
    if getattr(config, "hidden_size_per_layer_input", None):  # Gemma 4's per-layer inputs, once per token
        decoder += linear("per_layer_model_projection", config.hidden_size,
                          layers * config.hidden_size_per_layer_input)
    if config.model_type == "gemma3n_text":  # AltUp's copies of the hidden state made, and merged back: two
        # ModuleLists of altup_num_inputs - 1 layers, which peft names 0, 1, ...
        decoder += 2 * sum(linear(str(i), config.hidden_size, config.hidden_size)
                           for i in range(config.altup_num_inputs - 1))
    # Apertus 1.5's output layer keeps the first output_vocab_size rows (its text tokens) of the vocabulary
    head_in, head_out = config.hidden_size, getattr(config, "output_vocab_size", None) or config.vocab_size
    head = 2 * (3 if "lm_head" in trained else weight_passes) * head_in * head_out
    if lora_r and "lm_head" in lora_targets:
        head += 2 * 3 * lora_r * (head_in + head_out)
    per_pair = sum(pair_flops)
    windows, chunks = tuple(layer_windows(config)), tuple(layer_chunks(config))
    return ModelFlops(per_token=float(decoder + head), per_pair=float(per_pair),
                      windows=windows if any(w is not None for w in windows) else (),
                      chunks=chunks if any(c is not None for c in chunks) else (),
                      pair_shares=tuple(f / per_pair for f in pair_flops) if len(set(pair_flops)) > 1 else (),
                      layer_flops=tuple(per_layer))


def _shape(config: Any) -> dict:
    """The sizes a decoder layer's linear layers take, from its config (:func:`layer_configs`)."""
    heads = config.num_attention_heads
    return {
        "hidden": config.hidden_size, "heads": heads,
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        # Llama 4's dense layers: intermediate_size_mlp (its experts and shared expert: intermediate_size);
        # Cohere2-MoE's: prefix_dense_intermediate_size (its experts: intermediate_size)
        "intermediate": (getattr(config, "intermediate_size_mlp", None)  # Solar Open: none (no dense layer)
                         or getattr(config, "prefix_dense_intermediate_size", None)
                         or getattr(config, "intermediate_size", None) or 0),
    }


def _value_head_dim(config: Any) -> int:
    return getattr(config, "v_head_dim", None) or attention_head_dim(config)


def _attention_linears(config: Any, shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a decoder layer's attention: Llama's q, k, v and o,
    or DeepSeek's multi-head latent attention (transformers 5.24 models/deepseek_v3, DeepseekV3Attention):
    q_proj, or q_a_proj -> q_b_proj (q_lora_rank); kv_a_proj_with_mqa to the latent and the shared
    RoPE key, kv_b_proj from the latent to every head's key (no RoPE part) and value; o_proj."""
    if getattr(config, "qk_nope_head_dim", None) is None:
        linears = {name: _LAYER_LINEARS[name](shape) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        values = getattr(config, "v_head_dim", None)  # MiMo-V2-Flash: values narrower than the keys
        if values:
            linears["v_proj"] = (shape["hidden"], shape["kv_heads"] * values)
            linears["o_proj"] = (shape["heads"] * values, shape["hidden"])
        if config.model_type in ("afmoe", "beam"):  # Afmoe's and Beam's gate_proj: a sigmoid gate on each head's output
            linears["gate_proj"] = _LAYER_LINEARS["q_proj"](shape)
        if config.model_type == "laguna":  # LagunaAttention.g_proj: a softplus gate per head, or per element
            per_head = config.gating is True or config.gating == "per-head"
            linears["g_proj"] = (shape["hidden"], shape["heads"] * (1 if per_head else shape["head_dim"]))
        return linears
    hidden, heads, latent = shape["hidden"], shape["heads"], config.kv_lora_rank
    queries = heads * attention_head_dim(config)
    q_rank = getattr(config, "q_lora_rank", None)
    q = ({"q_proj": (hidden, queries)} if q_rank is None
         else {"q_a_proj": (hidden, q_rank), "q_b_proj": (q_rank, queries)})
    return {**q, "kv_a_proj_with_mqa": (hidden, latent + config.qk_rope_head_dim),
            "kv_b_proj": (latent, heads * (config.qk_nope_head_dim + config.v_head_dim)),
            "o_proj": (heads * config.v_head_dim, hidden)}


#: The MLP's layers: an MoE runs them once per routed expert.
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: Families whose MLP is down_proj(act(up_proj(x))), without a gate (transformers 5.24 ApertusMLP, ArceeMLP).
_UNGATED_MLP = {"apertus", "apertus1p5_text", "arcee", "jais2", "nanochat",
                "starcoder2"}  # StarCoder2's c_fc and c_proj by their shapes
#: The layers of _LAYER_LINEARS a fused layer replaces.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _lora_layers(config: Any, targets: tuple[str, ...], modules_to_save: tuple[str, ...]):
    """(the names of the layers LoRA adapts, the names of the Linear layers trained in full): ``targets``
    as they are, or for ``all-linear`` the layers peft adapts; a Linear layer is trained in full when its
    module or one holding it ends with a name of ``modules_to_save`` (a fused one: the layers it
    replaces). Builds the model on the meta device only to resolve those two."""
    from llama_cp.model.build import ALL_LINEAR, lora_targets
    from llama_cp.modules.causal_lm import build_causal_lm

    if ALL_LINEAR not in targets and not modules_to_save:
        return tuple(targets), frozenset()
    model = build_causal_lm(config, device="meta")
    trained = set()
    for name, module in model.named_modules():
        parts = name.split(".")
        held_by = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
        if name and isinstance(module, torch.nn.Linear) and any(key.endswith(save) for key in held_by
                                                                 for save in modules_to_save):
            trained.add(parts[-1])
    trained |= {part for fused in trained & _FUSED_PARTS.keys() for part in _FUSED_PARTS[fused]}
    return lora_targets(model, targets), frozenset(trained)


def _moe(config: Any, index: int = 0) -> tuple[int, int]:
    """(experts per token, experts) of decoder layer ``index`` of an MoE config; (0, 0) for a dense one."""
    experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or getattr(config, "n_routed_experts", None) or 0)  # GLM-4.5 in transformers 4 (5 aliases it)
    top_k = getattr(config, "num_experts_per_tok", None) or 0
    if config.model_type == "hunyuan_v1_moe":  # Hunyuan-A13B's moe_topk: one, or one per layer
        top_k = config.moe_topk[index] if isinstance(config.moe_topk, list) else config.moe_topk
    return (top_k, experts) if experts and top_k else (0, 0)


def _shared_expert(config: Any) -> tuple[int, int]:
    """(intermediate size of the MLP every token runs beside the routed experts, outputs of its gate):
    Qwen2-MoE's ``shared_expert`` gated by a Linear(hidden, 1), GLM-4.5's ``n_shared_experts`` experts
    as one ungated MLP (transformers 5.24 models/qwen2_moe, models/glm4_moe); (0, 0): none."""
    if config.model_type == "mimo_v2_flash":  # MiMoV2FlashMoE drops DeepSeek-V3's shared experts, whatever the config
        return 0, 0
    if getattr(config, "shared_intermediate_size", None):  # GraniteMoeShared's shared_mlp (input_linear, gated)
        return config.shared_intermediate_size, 0
    if getattr(config, "shared_expert_intermediate_size", None):  # Laguna's and Flint's: ungated
        return config.shared_expert_intermediate_size, int(config.model_type == "qwen2_moe")
    shared = getattr(config, "n_shared_experts", None) or getattr(config, "num_shared_experts", None)  # EXAONE's name
    if shared and config.model_type == "cohere2_moe":  # Cohere2MoeSparseMoeBlock: of intermediate_size each
        return shared * config.intermediate_size, 0
    if shared:
        return shared * config.moe_intermediate_size, 0
    if getattr(config, "moe_num_shared_experts", None):  # ERNIE 4.5's, one ungated MLP
        return config.moe_num_shared_experts * config.moe_intermediate_size, 0
    if config.model_type == "hunyuan_v1_moe":  # HunYuanMoEV1Moe.shared_mlp, a Llama MLP
        return config.intermediate_size, 0
    if config.model_type == "llama4_text":  # Llama4TextMoe.shared_expert, ungated
        return config.intermediate_size, 0
    return 0, 0


def _is_moe_layer(config: Any, index: int) -> bool:
    """Whether decoder layer ``index`` has experts (Qwen2/3-MoE: not in ``mlp_only_layers`` and every
    ``decoder_sparse_step``-th; GLM-4.5: from ``first_k_dense_replace`` on; Llama 4: in ``moe_layers``; ERNIE 4.5:
    every ``moe_layer_interval``-th from ``moe_layer_start_index`` to ``moe_layer_end_index``; EXAONE-MoE:
    its ``mlp_layer_types`` "sparse";
    Mixtral and OLMoE: every layer)."""
    if config.model_type == "solar_open":  # Solar Open: every layer (its config drops GLM-4.5's first_k_dense_replace)
        return True
    if getattr(config, "moe_layers", None) is not None:
        return index in config.moe_layers
    if getattr(config, "mlp_layer_types", None):  # EXAONE-MoE: "dense" or "sparse" by layer
        return config.mlp_layer_types[index] == "sparse"
    if getattr(config, "moe_layer_interval", None):  # ERNIE 4.5: every interval-th layer from start to end
        return ((index + 1) % config.moe_layer_interval == 0
                and config.moe_layer_start_index <= index <= config.moe_layer_end_index)
    if index in (getattr(config, "mlp_only_layers", None) or ()) or index < (
            getattr(config, "first_k_dense_replace", None) or getattr(config, "num_dense_layers", None) or 0):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (index + 1) % step == 0


def attention_pairs(position_ids: torch.Tensor, document_mask: bool = True, window: int | None = None,
                    chunk: int | None = None) -> int:
    """Visible (query, key) pairs of a batch of whole rows, (B, L) global ``position_ids``:
    causal within each packed document (``document_mask``), else causal over the row; a query
    sees at most ``window`` keys (a sliding window), and only those of its ``chunk`` (Llama 4's
    chunked attention: Note [Chunked attention under CP] in llama_cp/attention/chunks.py)."""
    from llama_cp.attention.chunks import chunk_starts
    from llama_cp.parallel.sharding import document_starts, visible_pairs_per_token

    position_ids = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    starts = document_starts(position_ids) if document_mask else torch.zeros_like(position_ids)
    if chunk is not None:
        starts = chunk_starts(starts, position_ids if document_mask else None, chunk)
    return int(visible_pairs_per_token(starts, window).sum())


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOP/s of the device called exactly ``device_name``
    (``torch.cuda.get_device_name()``, looked up in ``PEAK_BF16_FLOPS``); None for a name not in
    the table, or no device (CPU)."""
    return None if device_name is None else PEAK_BF16_FLOPS.get(device_name)


def throughput(*, tokens: int, flops: float, seconds: float, world_size: int, peak: float | None) -> dict[str, float]:
    """A step's per-GPU figures: ``tokens`` and model ``flops`` of the whole step (all ranks)
    in ``seconds`` on ``world_size`` GPUs; ``mfu`` (a fraction) only with a ``peak``."""
    flops_per_gpu = flops / world_size / seconds
    row = {"tokens_per_sec_per_gpu": tokens / world_size / seconds, "model_tflops_per_gpu": flops_per_gpu / 1e12}
    if peak:
        row["mfu"] = flops_per_gpu / peak
    return row
