"""Compiled target backend: a forward-only, pure-PyTorch re-implementation of the common target
families, returning only the features a draft trains on (the same `Features` as
models/target.Target, which stays the reference: any HF causal LM, eager).

Families: Llama 3.x (llama3 rope scaling), Qwen2 (q/k/v biases), Qwen3 (per-head RMSNorm of q
and k before rope), Qwen3-MoE (softmax router, top-k, optional renormalisation of the top-k
weights, experts through one grouped GEMM). Parameter names are Hugging Face's, so a
checkpoint's safetensors load with `load_state_dict(assign=True)` and an HF model's weights can
be shared without a copy (`from_hf_model`).

What makes it fast (gpt-fast / torchtitan style):
  * bf16, no autograd, no KV cache, no output_hidden_states: the aux layers' outputs are kept,
    the rest is dropped as soon as the next layer has read it; with need_final=False the layers
    after the last aux layer are neither built nor loaded.
  * torch.compile of the decoder layer, the repeated unit: every layer reuses the one compiled
    graph (parameters are graph inputs). mode="reduce-overhead" adds CUDA graphs; they pay off
    when shapes repeat (fixed-length packed rows) and kernels are small (MoE routing).
  * attention: full rows (no padding, one document) use SDPA's causal kernel (FlashAttention /
    cuDNN); rows with padding or several packed documents use FlexAttention with the document
    mask of kernels/masks.py, whose block sparsity skips padding and cross-document blocks;
    compiled on CPU, SDPA with the dense mask instead (see dense_attention_mask for why).
  * MoE experts: (token, expert) pairs sorted by expert, group ends by searchsorted (no host
    sync: bincount would sync, and CUDA graphs could not capture it), one grouped GEMM per
    projection, a deterministic sum over the top-k slots. torch._grouped_mm (F.grouped_mm where
    present): torch >= 2.9 on CUDA sm80+ in bf16 (the H200 path), and on CPU, where torch 2.13's
    eager kernel takes fp32 too but its meta function (hence inductor) only bf16. Requirements:
    16-byte aligned pointers and strides (K, N multiples of 8 in bf16), int32 cumulative offsets;
    group sizes need no padding in forward (torchtitan pads to 8 for the backward's K-grouped
    GEMM). Elsewhere a padded batched matmul (one host sync). Never a Python loop over experts.

Tensor parallelism (`FastTarget.parallelize(tp_mesh)`, Megatron-LM style): q/k/v and gate/up
column-parallel, o and down row-parallel, MoE experts split along their intermediate dimension;
head counts are read from the projected shapes (view(..., -1, head_dim)), so a layer runs
unchanged on its local heads. Plain sharded tensors + one functional all-reduce per sub-layer,
not DTensor: see `parallelize` for why.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from kernels.masks import create_block_mask, document_mask, flex_attention_compiled, flex_attention_eager, mask_grid
from models.layers import (
    LOCAL_ROPE,
    MLP,
    Projections,
    RMSNorm,
    apply_rope,
    layer_shape,
    merge_heads,
    rope_cos_sin,
    rope_inv_freq,
)
from models.target import HEADS_FILE, Features, default_aux_layers, resolve_target, seed_drawn_at_load

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def _qwen3(
    model_type: str, hidden_size: int, intermediate_size: int, num_hidden_layers: int, num_key_value_heads: int, **moe
) -> dict:
    """A Qwen3 (-MoE) config.json: the fields Qwen3-8B and Qwen3-30B-A3B share, written once, and the
    MoE fields `moe`, in the files' key order (router_aux_loss_coef after use_sliding_window)."""
    router = {"router_aux_loss_coef": moe.pop("router_aux_loss_coef")} if "router_aux_loss_coef" in moe else {}
    return dict(
        model_type=model_type,
        vocab_size=151936,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=32,
        num_key_value_heads=num_key_value_heads,
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        **moe,
        use_sliding_window=False,
        **router,
        bos_token_id=151643,
        eos_token_id=151645,
    )


# Real config.json values of the benchmark targets (random weights are built from these).
PRESETS = {
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-8b": _qwen3("qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_key_value_heads=8),
    "qwen3-30b-a3b": _qwen3(
        "qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
    ),
}


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 always; Llama/Qwen3 with attention_bias (then o_proj too)
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3 / Qwen3-MoE
    num_experts: int = 0  # > 0: Qwen3-MoE sparse layers
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # (read by Eagle3Config.from_target)
    hf: dict = field(default_factory=dict, repr=False)  # the config.json it came from

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict) -> "TargetConfig":
        """From a config.json dict (or an HF config's to_dict()); raises for what is not built here."""
        kind = d.get("model_type")
        if kind not in FAMILIES:
            raise NotImplementedError(
                f"compiled backend: model_type {kind!r} not supported ({', '.join(FAMILIES)}); use --backend hf"
            )
        if d.get("hidden_act", "silu") != "silu" or d.get("mlp_bias"):
            raise NotImplementedError("compiled backend: only silu MLPs without biases")
        if d.get("use_sliding_window") and kind != "llama":
            raise NotImplementedError("compiled backend: sliding-window attention is not implemented")
        shape = layer_shape(d)
        del shape["hidden_act"]  # silu, checked above
        rope = shape["rope_parameters"]
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("compiled backend: partial rotary embeddings")
        bias = bool(d.get("attention_bias", False))
        return cls(
            model_type=kind,
            **shape,
            num_hidden_layers=d["num_hidden_layers"],
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bias,
            o_bias=kind != "qwen2" and bias,
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            num_experts=(d.get("num_experts") or d.get("num_local_experts") or 0) if kind == "qwen3_moe" else 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            hf=dict(d),
        )

    @classmethod
    def preset(cls, name: str) -> "TargetConfig":
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_dict(PRESETS[name])

    def to_hf(self):
        """The transformers config of the same model (to build the HF reference)."""
        from transformers import AutoConfig  # lazy: transformers (~1.5 s), only for the HF reference

        d = dict(self.hf) or {k: v for k, v in asdict(self).items() if k != "hf"}
        return AutoConfig.for_model(**d)


# --------------------------------------------------------------------------------------- layers
def dense_attention_mask(block_mask) -> torch.Tensor:
    """The element mask [B, H, Q, KV] (bool; H = 1 for a head-independent mask) of a
    self-attention BlockMask, evaluated from its mask_mod; a query row that may see no key
    (padding) sees itself instead, so no softmax row is empty and no NaN appears (its output is
    garbage, as flex's zeros are: callers ignore padding positions).

    What compiled layers use on CPU instead of flex: in torch 2.13 inductor lowers flex on CPU to
    its C++ template (cpp_flex_attention_template.py), whose q @ k^T micro-GEMM
    (CppMicroGemmFP32Vec, transposed B, BLOCK_N 16) takes its "first implementation" for the
    N tail whenever the tail is a multiple of the vector width and head_dim < 24; that path
    loads and stores BLOCK_N = 16 columns instead of the tail's N. With AVX2 (8 floats) a kv
    length = 8 mod 16 (e.g. 24) and head_dim 8 or 16 hits it: it reads k rows past the tail
    (past the end of the k buffer for the last batch row and head: heap garbage, NaN at times)
    and writes 8 floats past the q @ k^T tile into the running row maxima of the first 8
    queries, so rows of the padded batch came out wrong by O(1), or NaN, differently from call
    to call (the NaN of one row's k then reaches another row through the same over-read; with
    MoE layers the whole batch went NaN). AVX-512 (16 floats) never takes that path for a tail
    < 16, hence no failure there; with ATEN_CPU_CAPABILITY=default (no vector ISA) inductor
    refuses flex on CPU ("torch.compile on current platform is not supported for CPU"). No
    upstream issue found; the micro-GEMM's transposed-B / N-tail path came with
    pytorch/pytorch#147068.
    Eager CPU keeps unfused flex (the reference); CUDA keeps flex (Triton) compiled."""
    B, H, Q, KV = block_mask.shape  # B, H: 1 where the mask is shared (broadcasts)
    assert Q == KV, "self-attention masks only"
    dev = block_mask.kv_num_blocks.device
    m = mask_grid(block_mask.mask_mod, B, H, Q, KV, device=dev)
    eye = torch.eye(Q, dtype=torch.bool, device=dev)
    return m | (~m.any(-1, keepdim=True) & eye)


class Attention(Projections):
    """Under --tp, q / k / v are column-parallel and o row-parallel: head counts are read from the shapes."""

    def __init__(self, c: TargetConfig):
        H, D = c.hidden_size, c.head_dim
        super().__init__(H, H, c.num_attention_heads, c.num_key_value_heads, D, c.qkv_bias, c.o_bias)
        self.q_norm = RMSNorm(D, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(D, c.rms_norm_eps) if c.qk_norm else None

    def project(self, x_BTH, cos, sin):
        """q [B, Hq, T, D], k and v [B, Hkv, T, D], rope applied (also the KV-cache decoder's,
        models/generate.py)."""
        B, T, _ = x_BTH.shape
        q = self.q_proj(x_BTH).view(B, T, -1, self.head_dim)
        k = self.k_proj(x_BTH).view(B, T, -1, self.head_dim)
        v = self.v_proj(x_BTH).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x_BTH, cos, sin, block_mask):
        q, k, v = self.project(x_BTH, cos, sin)
        gqa = q.shape[1] != k.shape[1]
        if block_mask is None:  # whole rows: the fused causal kernel
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        elif x_BTH.device.type == "cpu" and torch.compiler.is_compiling():
            # compiled on CPU: SDPA with the dense mask, not inductor's C++ flex template (see
            # dense_attention_mask: that template reads and writes out of bounds on AVX2)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_attention_mask(block_mask), enable_gqa=gqa)
        else:  # padding / packed documents: block-sparse flex (in-graph when the layer is compiled)
            # inside a compiled (CUDA) layer the plain function is traced into the graph; eager CPU
            # runs it unfused (tests); eager CUDA takes the one compiled flex of kernels/masks.py
            raw = torch.compiler.is_compiling() or not x_BTH.is_cuda
            flex = flex_attention_eager if raw else flex_attention_compiled
            o = flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        return self.o_proj(merge_heads(o))


class Router(nn.Module):
    def __init__(self, c: TargetConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size))


class Experts(nn.Module):
    """All experts' weights stacked (transformers 5 layout): gate_up_proj [E, 2I, H] (gate rows
    first), down_proj [E, H, I]."""

    def __init__(self, c: TargetConfig):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))


def grouped_mm_supported(device: torch.device) -> bool:
    """torch._grouped_mm exists and runs here: CUDA sm80+ (torch >= 2.9; the kernel is bf16 only)
    or CPU (torch >= 2.9, any dtype in eager; inductor traces only bf16: its meta checks it)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0) if device.type == "cuda" else device.type == "cpu"


def grouped_mm(x_SK, w_EKN, offs_E):
    """Rows [offs[e-1], offs[e]) of x times w[e], one kernel."""
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return mm(x_SK, w_EKN, offs=offs_E)


@torch.library.custom_op("nanospec::padded_bmm", mutates_args=())
def padded_bmm(x_SK: torch.Tensor, w_EKN: torch.Tensor, expert_S: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Fallback for grouped_mm: scatter the expert-sorted rows into [E, C, K] (C = the largest
    group: one host sync, hence an opaque op to torch.compile), one bmm, gather back."""
    counts = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    C = max(int(counts.max()), 1)
    slot = torch.arange(x_SK.shape[0], device=x_SK.device) - (offs_E - counts).long()[expert_S]
    buf = x_SK.new_zeros(w_EKN.shape[0], C, x_SK.shape[1])
    buf[expert_S, slot] = x_SK
    return torch.bmm(buf, w_EKN)[expert_S, slot]


@padded_bmm.register_fake
def _(x_SK, w_EKN, expert_S, offs_E):
    return x_SK.new_empty(x_SK.shape[0], w_EKN.shape[2])


class SparseMoE(nn.Module):
    """Qwen3-MoE block: softmax router -> top-k (renormalised if norm_topk_prob) -> experts."""

    def __init__(self, c: TargetConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = c.num_experts_per_tok, c.norm_topk_prob
        self.gate = Router(c)
        self.experts = Experts(c)
        self.use_grouped_mm = False  # set once the weights are on a device (FastTarget._init_buffers)

    def forward(self, x_BTH):
        B, T, H = x_BTH.shape
        x = x_BTH.reshape(-1, H)
        N, k, E = x.shape[0], self.top_k, self.gate.weight.shape[0]
        logits = F.linear(x, self.gate.weight)  # [N, E]
        w_Nk, idx_Nk = logits.float().softmax(-1).topk(k, dim=-1)
        if self.norm_topk_prob:
            w_Nk = w_Nk / w_Nk.sum(-1, keepdim=True)
        w_Nk = w_Nk.to(x.dtype)
        # sort the N*k (token, expert) pairs by expert; offs[e] = end of expert e's rows
        expert_S, order_S = idx_Nk.reshape(-1).sort(stable=True)
        offs = torch.searchsorted(expert_S, torch.arange(1, E + 1, device=x.device), out_int32=True)
        xs = x[order_S // k]  # [S, H], S = N*k
        gate_up, down = self.experts.gate_up_proj.transpose(1, 2), self.experts.down_proj.transpose(1, 2)
        if self.use_grouped_mm and (x.dtype == torch.bfloat16 or not (x.is_cuda or torch.compiler.is_compiling())):
            h = grouped_mm(xs, gate_up, offs)  # [S, 2I]
            g, u = h.chunk(2, dim=-1)
            y = grouped_mm(F.silu(g) * u, down, offs)  # [S, H]
        else:
            h = padded_bmm(xs, gate_up, expert_S, offs)
            g, u = h.chunk(2, dim=-1)
            y = padded_bmm(F.silu(g) * u, down, expert_S, offs)
        y = y * w_Nk.reshape(-1)[order_S, None]
        out = torch.empty_like(y).index_copy_(0, order_S, y)  # back to (token, slot) order
        return out.view(N, k, H).sum(1).view(B, T, H)  # (a deterministic sum, unlike index_add_)


class Block(nn.Module):
    def __init__(self, c: TargetConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SparseMoE(c) if c.is_moe(layer) else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, cos, sin, block_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, block_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):  # named like transformers' `model.` so checkpoint keys match
    def __init__(self, c: TargetConfig, n_layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(n_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


# ---------------------------------------------------------------------------------------- model
def positions_from_docs(doc_ids_BT: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document (packed rows restart at 0 per document)."""
    B, T = doc_ids_BT.shape
    t = torch.arange(T, device=doc_ids_BT.device).expand(B, T)
    start = torch.ones_like(doc_ids_BT, dtype=torch.bool)
    start[:, 1:] = doc_ids_BT[:, 1:] != doc_ids_BT[:, :-1]
    return t - torch.where(start, t, 0).cummax(dim=1).values


class FastTarget(nn.Module):
    """Frozen target, forward only; interface of models/target.Target (forward -> Features,
    embed_tokens, lm_head, config, aux_layers, path)."""

    def __init__(self, config: TargetConfig, aux_layers=None, need_final: bool = True, path: Path | None = None):
        super().__init__()
        c = self.config = config
        L = c.num_hidden_layers
        self.aux_layers = list(aux_layers) if aux_layers else default_aux_layers(L)
        if any(not 0 <= i < L for i in self.aux_layers):
            raise ValueError(f"aux_layers {self.aux_layers} out of range for a {L}-layer target")
        self.need_final, self.path = need_final, path
        self.model = Decoder(c, L if need_final else max(self.aux_layers) + 1)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if (kind := c.rope_parameters.get("rope_type", "default")) not in LOCAL_ROPE:
            raise NotImplementedError(
                f"compiled backend: rope_type {kind!r} (default, linear and llama3 are built); use --backend hf"
            )
        inv_freq, self.rope_scale = rope_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    # ---- construction: meta device first, then real storage exactly once ----
    @classmethod
    def from_config(
        cls, config: TargetConfig, aux_layers=None, dtype=torch.bfloat16, device="cuda", need_final=True, seed=0
    ):
        """Random weights (normal, std 0.02; norms 1; biases 0), allocated on `device` directly."""
        with torch.device("meta"):
            m = cls(config, aux_layers, need_final)
        m = m.to(dtype).to_empty(device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=g)
        m._init_buffers(device)
        return m.eval()

    @classmethod
    def from_pretrained(cls, spec, aux_layers=None, dtype=torch.bfloat16, device="cuda", need_final=True):
        """An HF directory (or anything models.target.resolve_target takes): safetensors are
        memory-mapped and streamed tensor by tensor to `device`, then assigned (no init). A directory of
        tools/random_target.py --no-weights has none: its weights are drawn here, as from_config with its seed, and
        with --heads the embeddings, final norm and lm_head are then read from its HEADS_FILE (those that training
        from features captured here reads: the two must agree)."""
        path = resolve_target(str(spec))
        config = TargetConfig.from_dict(json.loads((path / "config.json").read_text()))
        if (seed := seed_drawn_at_load(path)) is not None:  # tools/random_target.py --no-weights: drawn here
            m = cls.from_config(config, aux_layers, dtype, device, need_final, seed)
            m.path = path
            if (path / HEADS_FILE).exists():
                own = m.state_dict()
                with safe_open(str(path / HEADS_FILE), framework="pt", device="cpu") as st, torch.no_grad():
                    for k in st.keys() & own.keys():  # a tensor this build lacks is dropped, as _assign does
                        own[k].copy_(st.get_tensor(k))  # a tied lm_head is the embedding: copied once with it
            return m
        with torch.device("meta"):
            m = cls(config, aux_layers, need_final, path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors files (the compiled backend reads only safetensors)")
        sd = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for k in st.keys():
                    sd[k] = st.get_tensor(k).to(device=device, dtype=dtype)
        return m._assign(sd, device)

    @classmethod
    def from_hf_model(cls, hf_model, aux_layers=None, need_final=True):
        """Share an HF model's weights (no copy): the HF backend and this one on one set of weights."""
        config = TargetConfig.from_dict(hf_model.config.to_dict())
        with torch.device("meta"):
            m = cls(config, aux_layers, need_final, getattr(hf_model, "name_or_path", None))
        device = next(hf_model.parameters()).device
        return m._assign(dict(hf_model.state_dict()), device)

    def _assign(self, sd: dict, device):
        """Checkpoint names -> ours: per-expert weights (hub checkpoints) are stacked into the
        transformers-5 layout; layers we did not build and stray buffers are dropped."""
        want = self.state_dict()
        experts: dict[str, dict] = {}
        out = {}
        for k, t in sd.items():
            if ".mlp.experts." in k and k.endswith("_proj.weight") and k.split(".mlp.experts.")[1][0].isdigit():
                prefix, rest = k.split(".mlp.experts.")
                e, proj = rest.split(".")[:2]
                experts.setdefault(prefix, {})[(int(e), proj)] = t
            elif k in want:
                out[k] = t
        for prefix, parts in experts.items():
            E = 1 + max(e for e, _ in parts)
            gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(E)]
            if f"{prefix}.mlp.experts.gate_up_proj" in want:
                out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
                out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(E)])
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
            want.pop("lm_head.weight", None)
        missing = sorted(set(want) - set(out))
        if missing:
            raise KeyError(f"compiled backend: checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        self.load_state_dict(out, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._init_buffers(device)
        return self.eval().requires_grad_(False)

    def _init_buffers(self, device):
        self.inv_freq = rope_inv_freq(self.config)[0].to(device)
        for m in self.modules():
            if isinstance(m, SparseMoE):
                m.use_grouped_mm = grouped_mm_supported(torch.device(device))

    def compile_layers(self, mode: str | None = None, dynamic: bool | None = False):
        """Compile the decoder layer once for all layers. mode: None (inductor default),
        'max-autotune-no-cudagraphs', 'reduce-overhead' (CUDA graphs), 'max-autotune'."""
        self.cudagraphs = mode in ("reduce-overhead", "max-autotune")
        for layer in self.model.layers:
            layer.compile(mode=mode, fullgraph=True, dynamic=dynamic)
        return self

    # ---- tensor parallelism ----
    def parallelize(self, tp_mesh) -> "FastTarget":
        """Tensor parallelism over the 1-D DeviceMesh `tp_mesh` (Megatron-LM, Shoeybi et al. 2019),
        in place; call it before compile_layers. Every rank of the mesh must feed the same batch.

        Rank r of tp keeps: q/k/v rows of its heads (heads r*n/tp .. (r+1)*n/tp, KV heads likewise,
        so GQA groups stay on one rank), o_proj's matching columns; gate/up rows and down columns
        of its 1/tp of the intermediate dimension; every expert's slice of the same kind
        (gate_up [E, 2I/tp, H] = its gate rows then its up rows; down [E, H, I/tp]). Each attention
        and each MLP / MoE block thus returns a partial sum [B, T, H], completed by one all-reduce
        (a forward hook). Replicated: embeddings, norms (q/k norms are per head_dim), the router,
        lm_head. A row-parallel bias is kept on rank 0 only (zeros elsewhere) so the sum adds it once.

        Plain tensors sharded by hand + funcol.all_reduce rather than DTensor parallelize_module:
        the stacked gate_up layout needs a strided split (its gate and up halves each cut in tp
        pieces), which Shard(1) cannot express, and torch._grouped_mm / the padded-bmm custom op
        would need DTensor sharding rules; plain tensors keep the one compiled layer graph
        (functional collectives trace into it, as in gpt-fast) and every output a plain,
        replicated torch.Tensor, so the draft side is unchanged. On NCCL this is the same code."""
        tp, r = tp_mesh.size(), tp_mesh.get_local_rank()
        c = self.config
        if tp_mesh.ndim != 1:
            raise ValueError(f"parallelize takes a 1-D tensor-parallel mesh, got {tp_mesh.ndim}-D (pass mesh['tp'])")
        if getattr(self, "tp", 1) != 1:
            raise RuntimeError("this FastTarget is already tensor-parallel")
        sizes = {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads}
        if any(not c.is_moe(i) for i in range(len(self.model.layers))):
            sizes["intermediate_size"] = c.intermediate_size
        if c.num_experts:
            sizes["moe_intermediate_size"] = c.moe_intermediate_size
        bad = {k: v for k, v in sizes.items() if v % tp}
        if bad:
            raise ValueError(
                f"tensor parallel size {tp} must divide {', '.join(f'{k}={v}' for k, v in bad.items())} "
                f"(each rank holds whole heads and an equal share of the MLP); choose --tp among the common divisors"
            )

        def shard(t, dim):  # rank r's contiguous 1/tp of dim, in its own storage (the full tensor is freed)
            return nn.Parameter(t.chunk(tp, dim)[r].clone(memory_format=torch.contiguous_format), requires_grad=False)

        group = tp_mesh.get_group().group_name  # a string: a constant for dynamo

        def all_reduce(module, args, partial_BTH):
            return funcol.all_reduce(partial_BTH, "sum", group)

        for layer in self.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj):  # column-parallel: rows = this rank's heads
                proj.weight = shard(proj.weight, 0)
                if proj.bias is not None:
                    proj.bias = shard(proj.bias, 0)
            a.o_proj.weight = shard(a.o_proj.weight, 1)  # row-parallel: columns = this rank's heads
            if a.o_proj.bias is not None and r != 0:
                a.o_proj.bias.data.zero_()
            a.register_forward_hook(all_reduce)
            m = layer.mlp
            if isinstance(m, SparseMoE):
                e = m.experts
                gate, up = e.gate_up_proj.chunk(2, dim=1)  # [E, I, H] each
                e.gate_up_proj = nn.Parameter(torch.cat([shard(gate, 1), shard(up, 1)], 1), requires_grad=False)
                e.down_proj = shard(e.down_proj, 2)
            else:
                m.gate_proj.weight, m.up_proj.weight = shard(m.gate_proj.weight, 0), shard(m.up_proj.weight, 0)
                m.down_proj.weight = shard(m.down_proj.weight, 1)
            m.register_forward_hook(all_reduce)
        self.tp = tp
        return self

    # ---- forward ----
    def rope(self, positions_BT: torch.Tensor, dtype):
        return rope_cos_sin(positions_BT, self.inv_freq, self.rope_scale, dtype)

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, doc_ids=None, position_ids=None) -> Features:
        """input_ids [B, T]. Either nothing (every row is one whole sequence: causal SDPA), or
        attention_mask [B, T] (right padding), or doc_ids [B, T] (packed rows: document label
        per token, -1 = padding; positions restart per document unless position_ids are given).
        Padded positions hold garbage in the returned features (as with the HF backend)."""
        B, T = input_ids.shape
        if doc_ids is None and attention_mask is not None:
            doc_ids = attention_mask.to(torch.int32) - 1  # one document per row, padding -1
        if position_ids is None:
            position_ids = (
                torch.arange(T, device=input_ids.device).expand(B, T)
                if doc_ids is None
                else positions_from_docs(doc_ids)
            )
        block_mask = None
        if doc_ids is not None:
            block_mask = create_block_mask(
                document_mask(doc_ids), B, None, T, T, device=input_ids.device, _compile=input_ids.is_cuda
            )
        if getattr(self, "cudagraphs", False):
            torch.compiler.cudagraph_mark_step_begin()  # last call's graph outputs may be reused
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(position_ids, h.dtype)
        want, captured = set(self.aux_layers), {}
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, block_mask)
            if i in want:
                captured[i] = h
        aux = torch.cat([captured[i] for i in self.aux_layers], dim=-1)  # (a copy: out of any graph pool)
        final = self.model.norm(h) if self.need_final else None
        return Features(aux_hidden=aux, final_hidden=final)
