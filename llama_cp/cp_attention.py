"""Context-parallel attention for HF Llama-family models: the entry that binds it to a model.

Each rank of the cp group holds 2 of the 2 x cp chunks of the sequence (the
zigzag layout of :mod:`llama_cp.parallel.sharding`). Everything in the model except
attention is per token, so attention is the only place where ranks talk.

:func:`apply_context_parallel` gives every attention layer of a model one
:class:`ContextParallelAttention` and registers :func:`cp_attention_forward` with
transformers' ``AttentionInterface`` as ``ATTENTION_NAME``. A forward pre-hook of the
decoder (``_prepare_decoder_call``) checks the batch and hands every layer its documents
(``DOCUMENTS_KWARG``); position-dependent RoPE gets the global sequence's maximum (Note
[Position-dependent RoPE under CP] in ``llama_cp/modules/rope.py``). The strategies live under
``llama_cp/attention/``, one file each:

- ring (zigzag): ``ring.py``, Note [Zigzag ring attention] and Note [Ring transfers];
- Ulysses (all-to-all): ``ulysses.py``;
- all-gather (Llama 3's long-context parallelism): ``allgather.py``;
- hybrid, Ulysses inside groups and the ring across them: ``hybrid.py``, Note [Hybrid attention];
- cp 1: ``local.py``, the ordinary local attention;
- ``--cp_strategy auto``: ``choose.py``, Note [Choosing a strategy];
- the bytes each strategy sends: ``wire_bytes`` in ``wire.py``.

Packed documents (position_ids that restart) change only which pairs each block
computes: see Note [Document masks under CP] in ``llama_cp/attention/documents.py``. A
step's block longer than ``block_size`` is computed in tiles: Note [Tiled
attention] there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llama_cp.attention import kernels, windows
from llama_cp.attention.allgather import _AllGatherAttention
from llama_cp.attention.chunks import chunked_layout, scale_queries, take_query_temperature
from llama_cp.attention.choose import STRATEGIES, Strategy
from llama_cp.attention.documents import DocumentLayout
from llama_cp.attention.hybrid import check_ulysses_degree, hybrid_attention, hybrid_groups
from llama_cp.attention.kernels import Backend
from llama_cp.attention.local import local_attention
from llama_cp.attention.ring import _RingAttention
from llama_cp.attention.ulysses import ulysses_attention
from llama_cp.modules.causal_lm import base_causal_lm
from llama_cp.modules.families import bind_decoder, check_supported
from llama_cp.modules.layers import attention_chunk, attention_heads, sliding_windows
from llama_cp.modules.rope import bind_global_rope
from llama_cp.parallel.sharding import SEQ_INDEX, check_attention_mask, document_starts, unshard, zigzag_index

#: Name under which the attention function is registered with transformers.
ATTENTION_NAME = "llama_cp"
#: Keyword under which the decoder hands the batch's :class:`DocumentLayout` to every attention call.
DOCUMENTS_KWARG = "llama_cp_documents"


# ---------------------------------------------------------------- HF binding
@dataclass(frozen=True)
class ContextParallelAttention:
    """The context-parallel attention bound to one attention module by :func:`apply_context_parallel`."""

    group: dist.ProcessGroup | None
    strategy: Strategy
    backend: Backend | None = None
    document_mask: bool = True
    #: tokens per query block and per key block of every local kernel call; 0: one call per block
    block_size: int = 0
    #: hybrid: the Ulysses and the ring sub-groups of ``group`` (Note [Hybrid attention])
    inner: dist.ProcessGroup | None = None
    outer: dist.ProcessGroup | None = None
    #: some layer has a sliding window: every batch gets a layout (Note [Sliding windows under CP])
    sliding: bool = False
    #: whether the decoder handed the layers of the current forward a layout (Note [Documents a layer
    #: drops]); set by the decoder's hook, read by every attention call
    handed: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def cp_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def gathered_layout(self, position_ids: torch.Tensor, seq_index: torch.Tensor | None) -> DocumentLayout:
        """The all-gather strategy's layout of a batch: its documents (one per row without
        ``document_mask``) and which rows every rank holds; ``seq_index`` (S/cp,): this rank's
        rows, None: the zigzag layout. A collective over the cp group."""
        rank, cp, device = dist.get_rank(self.group), self.cp_size, position_ids.device
        if seq_index is None:
            local_rows = zigzag_index(position_ids.shape[-1] * cp, cp, rank, device=device)
        else:
            local_rows = seq_index.to(device)
        gathered = [torch.empty_like(local_rows) for _ in range(cp)]
        dist.all_gather(gathered, local_rows, group=self.group)  # on the device: NCCL has no CPU tensors
        positions = unshard(position_ids, self.group, seq_index=local_rows)
        starts = document_starts(positions) if self.document_mask else torch.zeros_like(positions)
        return DocumentLayout(
            starts, cp_rank=rank, cp_size=cp, local_rows=local_rows.cpu(), gathered_rows=torch.cat(gathered).cpu(),
            positions=positions, single=not bool(starts.any()),  # every row one document: one call for all rows
        )

    def document_layout(self, position_ids: torch.Tensor) -> DocumentLayout | None:
        """The documents of a batch from its local (B, S/cp) global ``position_ids``; None when
        every row is one document (Note [Document masks under CP]). A collective over the cp group."""
        positions = unshard(position_ids, self.group)
        starts = document_starts(positions)
        if not bool(starts.any()):
            return None
        return dataclasses.replace(self.zigzag_layout(starts), positions=positions)

    def one_document_layout(self, rows: int, seq_len: int, device: torch.device) -> DocumentLayout:
        """The layout of ``rows`` rows of one document of ``seq_len`` tokens each (global): what the
        windowed layers run on when the batch has no documents (Note [Sliding windows under CP])."""
        starts = torch.zeros((rows, seq_len), dtype=torch.long, device=device)
        return self.zigzag_layout(starts, single=True)

    def query_rows(self, local_len: int, documents: DocumentLayout | None, device: torch.device) -> torch.Tensor:
        """(S/cp,) the global rows of this rank's tokens: the all-gather's ``local_rows``, else zigzag."""
        if documents is not None and documents.local_rows is not None:
            return documents.local_rows.to(device)
        if self.group is None:
            return torch.arange(local_len, device=device)
        return zigzag_index(local_len * self.cp_size, self.cp_size, dist.get_rank(self.group), device=device)

    def zigzag_layout(self, starts: torch.Tensor, single: bool = False) -> DocumentLayout:
        """The layout of (B, L) document ``starts`` on this rank's zigzag chunks (hybrid: the
        outer ring's); ``single``: every row one document (DocumentLayout.single)."""
        rank, size = (0, 1) if self.group is None else (dist.get_rank(self.group), self.cp_size)
        if self.strategy == "hybrid":  # the outer ring's layout: its ranks hold the ring's zigzag chunks
            rank, size = dist.get_rank(self.outer), dist.get_world_size(self.outer)
        return DocumentLayout(starts, cp_rank=rank, cp_size=size, single=single)

    def __call__(
        self, q, k, v, *, causal: bool, scale: float | None, documents: DocumentLayout | None = None,
        softcap: float = 0.0, window: int | None = None, sinks: torch.Tensor | None = None, chunk: int | None = None,
    ) -> torch.Tensor:
        """q: (B, H, S/cp, D), k/v: (B, Hkv, S/cp, D) -> (B, H, S/cp, D). ``documents``: attend
        only within each packed document (Note [Document masks under CP]); ``softcap``: Note
        [Soft-capped attention] in ``llama_cp/attention/windows.py``; ``window``: a sliding window of that
        many tokens (Note [Sliding windows under CP] in ``llama_cp/attention/documents.py``); ``sinks``
        (H,): a learned sink logit per head (Note [Attention sinks under CP] in
        ``llama_cp/attention/sinks.py``); ``chunk``: Llama 4's attention chunk of that many tokens
        (Note [Chunked attention under CP] in ``llama_cp/attention/chunks.py``)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        seq_len = q.shape[2] * self.cp_size
        if chunk is not None:  # each chunk a document of its own: the document paths of every strategy
            documents = chunked_layout(documents or self.one_document_layout(q.shape[0], seq_len, q.device), chunk)
        if window is not None and window < 1:
            raise ValueError(f"a sliding window must hold at least 1 token, got {window}")
        if window is not None and window >= seq_len:
            window = None  # it cuts nothing
        if window is not None and not causal:
            raise ValueError("sliding windows are causal here; got a non-causal attention call with a window")
        if window is not None and documents is None:  # one document per row: called without the decoder's hook
            documents = self.one_document_layout(q.shape[0], seq_len, q.device)
        if window is None and documents is not None and documents.single and self.strategy != "allgather":
            documents = None  # a full layer of a windowed model: the plain strategies
        if documents is not None and not causal:
            raise ValueError("document masks are causal; got a non-causal attention call with documents")
        if self.cp_size == 1:
            block = None if documents is None else documents.ring_pieces(0, window)
            return local_attention(
                q, k, v, causal=causal, scale=scale, backend=self.backend, block_size=self.block_size, block=block,
                softcap=softcap, sinks=sinks,
            )
        if self.strategy == "allgather":
            if documents is None or documents.gathered_rows is None:
                raise RuntimeError("all-gather attention called without its layout; call the model, not the layer")
            return _AllGatherAttention.apply(
                q, k, v, self.group, scale, self.backend, documents, self.block_size, softcap, window, sinks
            )
        if self.strategy == "ring":
            if q.shape[2] % 2:
                raise ValueError(
                    f"ring attention needs an even local sequence length (two zigzag chunks), got {q.shape[2]}; "
                    "shard the batch with llama_cp.shard_batch"
                )
            return _RingAttention.apply(
                q, k, v, self.group, causal, scale, self.backend, documents, self.block_size, softcap, window, sinks
            )
        if self.strategy == "hybrid":
            return hybrid_attention(
                q, k, v, self.inner, self.outer, causal=causal, scale=scale, backend=self.backend,
                documents=documents, block_size=self.block_size, softcap=softcap, window=window, sinks=sinks,
            )
        return ulysses_attention(
            q, k, v, self.group, causal=causal, scale=scale, backend=self.backend, documents=documents,
            block_size=self.block_size, softcap=softcap, window=window, sinks=sinks,
        )


def _prepare_decoder_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the decoder (``LlamaModel``), where the batch enters the model:
    refuse a padding mask (transformers would hand the attention None), require global
    ``position_ids`` under CP, and hand every attention layer the batch's documents (and,
    all-gather, which rows each rank holds: the batch's ``seq_index``)."""
    check_attention_mask(kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
    attention: ContextParallelAttention = module.cp_attention
    attention.handed["documents"] = False  # until a layout is handed below
    seq_index = kwargs.get(SEQ_INDEX)
    kwargs = {key: value for key, value in kwargs.items() if key != SEQ_INDEX}
    position_ids = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if position_ids is None:
        if attention.cp_size > 1:
            raise ValueError(
                "context-parallel model called without position_ids: each rank holds zigzag chunks of the "
                "sequence and needs their global positions; shard the batch with llama_cp.shard_batch, "
                "which creates them"
            )
        return args, kwargs
    gathered = attention.strategy == "allgather" and attention.cp_size > 1
    if seq_index is not None and not gathered:
        rank = 0 if attention.group is None else dist.get_rank(attention.group)
        zigzag = zigzag_index(seq_index.shape[0] * attention.cp_size, attention.cp_size, rank)
        if not torch.equal(seq_index.cpu(), zigzag):
            raise ValueError(
                f"this batch was sharded with shard_batch(layout='documents'), which only cp_strategy='allgather' "
                f"can run (this model uses {attention.strategy!r} at cp {attention.cp_size}); shard it with "
                "layout='zigzag' or use --cp_strategy allgather"
            )
    if attention.document_mask or gathered or attention.sliding:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        if tokens is not None:
            rows = tokens.shape[0]
        else:
            rows = position_ids.shape[0] if position_ids.dim() == 2 else 1
        positions = position_ids.reshape(-1, position_ids.shape[-1]).expand(rows, -1)
        if gathered:
            documents = attention.gathered_layout(positions, seq_index)
        else:
            documents = attention.document_layout(positions) if attention.document_mask else None
            if documents is None and attention.sliding:  # one layout for every windowed layer of the batch
                documents = attention.one_document_layout(rows, positions.shape[-1] * attention.cp_size,
                                                          positions.device)
        if documents is not None:
            kwargs = {**kwargs, DOCUMENTS_KWARG: documents}
    attention.handed["documents"] = DOCUMENTS_KWARG in kwargs
    return args, kwargs


@torch.compiler.disable  # Note [Compiled per-token modules]: dynamo runs it eager, a graph break
def cp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The function registered as ``attn_implementation="llama_cp"``; same signature as
    transformers' ``sdpa_attention_forward``. Returns ((B, S/cp, H, D), None)."""
    attention: ContextParallelAttention | None = getattr(module, "cp_attention", None)
    if attention is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attn_implementation={ATTENTION_NAME!r} but has no context-parallel "
            "binding; call llama_cp.apply_context_parallel(model, cp_mesh) instead of setting it by hand"
        )
    check_attention_mask(attention_mask)
    if dropout:
        raise ValueError(f"context-parallel attention does not support attention dropout (got {dropout})")
    for name, feature in UNCOMPUTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}= to its attention: {feature}, which context-parallel "
                "attention does not compute; this model cannot be trained with llama-cp"
            )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    # Note [A window held, not passed]
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    sinks = kwargs.get("s_aux")  # gpt_oss's learned sinks, (H,): Note [Attention sinks under CP]
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"{type(module).__name__} passes s_aux= of shape {tuple(sinks.shape)}; context-parallel "
                         f"attention computes one sink logit per query head, shape ({query.shape[1]},)")
    width = value.shape[-1]  # Note [Value heads narrower than keys]
    if width > query.shape[-1]:
        raise ValueError(f"{type(module).__name__}: value heads of {width} wider than its query/key heads of "
                         f"{query.shape[-1]}, which context-parallel attention does not compute (it pads narrower "
                         "ones: Note [Value heads narrower than keys]); this model cannot be trained with llama-cp")
    if width < query.shape[-1]:
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    documents = kwargs.get(DOCUMENTS_KWARG)
    if documents is None and attention.handed.get("documents"):  # Note [Documents a layer drops]
        raise RuntimeError(
            f"{type(module).__name__} was called without the batch's document layout, which the decoder handed its "
            "layers: a decoder layer of this model does not pass its keyword arguments on to attention, so packed "
            "documents (and all-gather's and the windows' layouts) cannot reach it; this model cannot be trained "
            "with llama-cp"
        )
    if getattr(module, "cp_temperature", None) is not None:  # Note [Query temperature under CP]
        query = scale_queries(query, attention.query_rows(query.shape[2], documents, query.device),
                              *module.cp_temperature)
    out = attention(query, key, value, causal=causal, scale=scaling, documents=documents,
                    softcap=kwargs.get("softcap") or 0.0, window=window, sinks=sinks, chunk=attention_chunk(module))
    return out[..., :width].transpose(1, 2).contiguous(), None


# Note [Documents a layer drops]
# ==============================
#
# The batch's document layout reaches attention as a keyword argument: the decoder's hook adds
# DOCUMENTS_KWARG to the decoder's kwargs, transformers' decoder hands **kwargs to each layer and
# each layer to its attention module, which passes them to the attention function. A decoder
# layer that calls its attention without **kwargs (transformers 5.24 NemotronDecoderLayer,
# StableLmDecoderLayer) drops the layout, and the attention would then see one document per row:
# packed documents attended as one, silently. So the hook records whether it handed a layout
# (ContextParallelAttention.handed, reset every forward), and an attention call without one after
# that is refused. Every supported family passes them (each one's packed-document check); this
# makes a release or a model whose layers do not fail loudly instead.

#: Keyword arguments of transformers' attention calls that change the result and that the kernel
#: does not compute (their names in transformers 5.24's modeling code and integrations/sdpa_attention.py);
#: refused when set, never dropped. (gpt_oss's sinks arrive as ``s_aux``, which is computed.)
UNCOMPUTED_KWARGS = {
    "sinks": "learned attention sinks in the softmax denominator",
    "position_bias": "an additive position bias on the scores",
}

# Note [Value heads narrower than keys]
# =====================================
#
# DeepSeek's multi-head latent attention (deepseek_v2, deepseek_v3: DeepSeek-V2/V3, Kimi K2,
# Moonlight) scores with query/key heads of qk_nope_head_dim + qk_rope_head_dim (192) and weighs
# value heads of v_head_dim (128) (transformers 5.24 models/deepseek_v3/modeling_deepseek_v3.py,
# DeepseekV3Attention.expand_kv: v unpadded). Every strategy's kernels and buffers hold k and v
# of one shape, so v is padded with zeros to the key width and the output sliced back:
#
#     v (B, H, S, 128) -> [v | 0] (B, H, S, 192) -> attention -> out[..., :128]
#
# Exact: the scores and their softmax (and lse, the sinks, every merge of the ring, Ulysses,
# all-gather and hybrid) read only q and k; each output column is sum_j p_ij v_jc on its own, so
# the first 128 are those of the unpadded call and the rest are 0. Backward: the slice hands the
# padded columns dO = 0, so dP = dO v^T and rowsum(dO * out) are unchanged, and the pad's
# backward hands v the first 128 columns of dv. The cost: the padded v travels and is computed
# as a key: 1 + (qk - v) / v times the value bytes on the wire and in the saved v and out (1.5x
# for DeepSeek-V3, 1.2x of k + v), and 3 of attention's 6 matmuls (p.v; dV, dP) at qk width (1.2x
# of its FLOPs). transformers 4.56.2 pads v the same way, itself, for flash_attention_2 only
# (models/deepseek_v2/modeling_deepseek_v2.py, DeepseekV2Attention.forward), so llama-cp's
# attention gets v unpadded there too. Values wider than the keys are refused.


# Note [A window held, not passed]
# ================================
#
# A sliding window reaches the kernel as the attention call's ``sliding_window=`` (Mistral,
# Qwen2, Gemma 2/3, ...). Qwen2-MoE's attention sets ``self.sliding_window`` on its windowed
# layers but does not pass it (transformers 5.24 models/qwen2_moe/modeling_qwen2_moe.py,
# Qwen2MoeAttention): single-process transformers windows those layers through the mask
# (create_sliding_window_causal_mask), and llama-cp's attention receives no mask, so without the
# module's own window they would attend over the whole sequence. Where the call passes no
# ``sliding_window``, the module's is used. In every family of SUPPORTED_FAMILIES, in 4.56.2 and
# 5.24, a module holding a window either passes a ``sliding_window=`` (Exaone 4 passes None on its
# full layers while holding the config's window: the kwarg wins) or is Qwen2-MoE's.


def apply_context_parallel(
    model: nn.Module,
    cp_mesh: DeviceMesh | dist.ProcessGroup | None,
    strategy: Strategy = "ring",
    *,
    backend: Backend | None = None,
    max_seq_len: int | None = None,
    document_mask: bool = True,
    block_size: int = 0,
    ulysses_degree: int = 0,
) -> nn.Module:
    """Make every attention layer of an HF Llama-family ``model`` context-parallel over ``cp_mesh``.

    The model then expects the zigzag shards made by :func:`llama_cp.shard_batch`
    (with global ``position_ids``) on every rank of the cp group. Only attention
    changes: parameter gradients stay per rank, and their sum over the cp group is
    the full-sequence gradient (reducing them is FSDP's job, see ``shard_model``).
    With a cp group of size 1 the attention is the ordinary local causal attention.

    ``document_mask`` (default): a row whose ``position_ids`` restart holds several
    packed documents, and each token attends only to the earlier tokens of its own
    document, as single-process transformers does (Note [Document masks under CP]).
    ``False``: every token attends to all earlier tokens of the row.

    ``block_size`` (``--attention_block_size``): every local kernel call covers at most that
    many queries x keys, so its workspace is per block, not per sequence (Note [Tiled
    attention] in ``llama_cp/attention/documents.py``); 0: one call per block of the strategy.

    Models llama-cp cannot compute exactly are refused here (``llama_cp.modules.families``);
    ``max_seq_len``, the longest global sequence to come, lets a sliding window be refused now
    rather than at the first forward when ``backend`` names one of torch's kernels that takes none
    (``windows.window_or_cap_backend``). A padding attention mask is refused when the model is called.

    ``strategy="hybrid"``: Ulysses inside groups of ``ulysses_degree`` consecutive cp ranks,
    the ring across them (Note [Hybrid attention]); the batch keeps the zigzag layout.
    """
    from transformers import AttentionInterface

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown cp strategy {strategy!r}; choose one of {STRATEGIES}")
    if backend is not None and backend not in kernels.BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {kernels.BACKENDS}")
    if block_size < 0:
        raise ValueError(f"attention block_size must be >= 0 (0 = untiled), got {block_size}")
    check_supported(model)
    layer_windows = sliding_windows(model)
    if backend is not None and layer_windows and max_seq_len and min(layer_windows) < max_seq_len:
        try:  # the kernels' own rule for which kernels take a window
            windows.window_or_cap_backend(backend, softcap=0.0)
        except ValueError as error:
            raise ValueError(f"--attention_backend {backend}: this model's sliding window of {min(layer_windows)} "
                             f"tokens is shorter than the sequence ({max_seq_len} tokens): {error}") from None
    group = cp_mesh.get_group() if isinstance(cp_mesh, DeviceMesh) else cp_mesh
    cp = 1 if group is None else dist.get_world_size(group)

    config = model.config
    heads, heads_name = attention_heads(config)
    if strategy == "ulysses" and heads % cp:
        raise ValueError(
            f"cp_strategy='ulysses' needs {heads_name} divisible by cp ({cp}); "
            f"use cp_strategy='ring' or a cp that divides {heads}"
        )
    check_ulysses_degree(strategy, ulysses_degree, cp, heads, heads_name)
    layers = [m for m in model.modules()
              # q_a_proj: DeepSeek's MLA with q_lora_rank, which transformers 4.56.2 builds without a q_proj
              if any(hasattr(m, name) for name in ("q_proj", "qkv_proj", "q_a_proj")) and hasattr(m, "o_proj")
              and hasattr(m, "config")]
    if not layers:
        raise ValueError(f"found no attention layers (modules with q_proj, qkv_proj or q_a_proj, and o_proj) in "
                         f"{type(model).__name__}")

    inner = outer = None
    if strategy == "hybrid" and cp > 1:
        inner, outer = hybrid_groups(group, ulysses_degree)
    attention = ContextParallelAttention(
        group=group if cp > 1 else None, strategy=strategy, backend=backend, document_mask=document_mask,
        block_size=block_size, inner=inner, outer=outer, sliding=bool(layer_windows),
    )
    bind_decoder(base_causal_lm(model))
    decoder = base_causal_lm(model).get_decoder()
    for module in (*layers, decoder):
        module.cp_attention = attention  # a plain attribute: bound per model, no module globals
    for module in layers:
        take_query_temperature(module)  # Note [Query temperature under CP]
    bind_global_rope(model, attention.group)
    if not getattr(decoder, "_llama_cp_hook", False):
        decoder.register_forward_pre_hook(_prepare_decoder_call, with_kwargs=True)
        decoder._llama_cp_hook = True
    AttentionInterface.register(ATTENTION_NAME, cp_attention_forward)
    model.set_attn_implementation(ATTENTION_NAME)
    return model
