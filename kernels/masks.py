"""FlexAttention mask factories (attention-gym style).

Every factory returns a `mask_mod(b, h, q_idx, kv_idx) -> bool` for
`torch.nn.attention.flex_attention`; combine them with `and_masks` / `or_masks` and turn them
into a BlockMask with `create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=...)`.
Tensors a mask reads (lengths, document ids, anchors) are captured by closure; their values
may change between calls without recompiling as long as their shapes stay the same.

Index tensors accept a batch dimension or not: a [T] tensor is shared by every batch row,
a [B, T] tensor is per row (the choice is made once, in Python, when the factory runs).

Conventions: True = may attend. A query whose row is entirely False gets a zero output from
flex (and from `dense_attention` below); callers zero its loss weight.
"""

import math

import torch
from torch.nn.attention.flex_attention import (  # noqa: F401  (re-exported for callers)
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
    or_masks,
)

# One compiled flex for the whole process (compile the repeated unit once); the eager handle
# is the reference and what runs where inductor is unavailable. Eager flex materialises the
# full score matrix, so it is only for tests and small shapes.
flex_attention_eager = flex_attention
flex_attention_compiled = torch.compile(flex_attention, dynamic=False)
# dynamic=False compiles once per shape, and TTT training calls flex with one K/V length per step for
# every 128-token length bucket (TTT 13 x 4 buckets at max_len 512 = 52 shapes, ~2 s each once).
# Dynamo's default limit (8) would silently fall back to eager flex past it, which materialises the
# scores (seen on the H200: the TTT 9 sweep runs slowed down, the TTT 13 ones ran out of memory).
# Set here, on import, for every user of flex (training, benchmarks, tests), not by each of them.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)


def flex_train(q, k, v, block_mask: BlockMask, enable_gqa: bool = False) -> torch.Tensor:
    """The compiled flex for a training forward. On CUDA it asks for flex's main Triton kernel: for
    queries shorter than 128 flex picks its decoding kernel, which found no configuration for a P-EAGLE
    training shape on the H200 (fp32, GQA, 104 tokens, with backward: NoValidChoicesError, torch 2.11);
    rows of 128 tokens and more get the main kernel anyway."""
    opts = {"kernel_options": {"BACKEND": "TRITON"}} if q.is_cuda else {}
    return flex_attention_compiled(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, **opts)


def _per_row(t: torch.Tensor):
    """index(b, i) into a [T] (shared) or [B, T] (per batch row) tensor."""
    if t.dim() == 1:
        return lambda b, i: t[i]
    assert t.dim() == 2, f"expected [T] or [B, T], got {tuple(t.shape)}"
    return lambda b, i: t[b, i]


def causal_mask(lengths: torch.Tensor | None = None):
    """Causal attention; with lengths [B] (int), queries and keys at >= lengths[b] are masked."""

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return causal if lengths is None else and_masks(causal, length_mask(lengths))


def length_mask(lengths: torch.Tensor):
    """Right padding: query and key positions must be < lengths[b] (lengths: [B] int)."""

    def in_length(b, h, q_idx, kv_idx):
        return (q_idx < lengths[b]) & (kv_idx < lengths[b])

    return in_length


def document_mask(doc_ids: torch.Tensor):
    """Packed sequences: doc_ids [T] or [B, T] (int) label the document of every token;
    causal within a document, never across. Negative ids mark padding (sees nothing)."""
    doc = _per_row(doc_ids)

    def same_document_causal(b, h, q_idx, kv_idx):
        d_q = doc(b, q_idx)
        return (d_q == doc(b, kv_idx)) & (d_q >= 0) & (q_idx >= kv_idx)

    return same_document_causal


def ttt_mask(step, seq_len: int, lengths: torch.Tensor | None = None, kv_stride: int | None = None):
    """EAGLE-3 training-time-test mask for TTT step `step` (0-based; an int, or a 0-dim tensor that compiled
    flex takes as an input rather than a constant: kernels/ttt_attention.py's one-shape unroll).

    Queries: the T = seq_len positions of the current step, q_idx in [0, T).
    Keys: the steps' keys concatenated along the sequence, [step0 | step1 | ... | step_k],
    each occupying `kv_stride` slots (default T; a larger stride lets a caller pad every step
    to a block multiple so steps do not share blocks), KV_LEN = (step + 1) * kv_stride.
    Query i sees step-0 keys j <= i and key i of each step 1..step; with lengths [B], queries
    at i >= lengths[b] see nothing (every key they could see would be padding).
    """
    stride = seq_len if kv_stride is None else kv_stride
    assert stride >= seq_len

    def ttt(b, h, q_idx, kv_idx):
        s = kv_idx // stride
        j = kv_idx - s * stride  # position of the key inside its step
        return ((s == 0) & (j <= q_idx)) | ((s > 0) & (s <= step) & (j == q_idx))

    def valid_query(b, h, q_idx, kv_idx):  # keys need no bound: j <= q_idx < lengths[b]
        return q_idx < lengths[b]

    return ttt if lengths is None else and_masks(ttt, valid_query)


def same_document(doc_ids: torch.Tensor, kv_stride: int | None = None):
    """Packed rows: the key carries the query's document label. doc_ids [T] or [B, T] (int); the
    keys may be several copies of the sequence concatenated (TTT steps), each kv_stride long
    (default: one copy), so key kv_idx reads label kv_idx % kv_stride. Unlike document_mask,
    padding (-1) counts as a document of its own: its queries see padding keys, so no row is
    empty on any path (lse's fused kernel would return NaN for one); padding is never trained."""
    doc = _per_row(doc_ids)
    stride = kv_stride

    def same_doc(b, h, q_idx, kv_idx):
        return doc(b, q_idx) == doc(b, kv_idx if stride is None else kv_idx % stride)

    return same_doc


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """Where each token's document starts in its row: doc_ids [T] or [B, T] (int), each document one
    contiguous run (data/packing.py; padding, -1, one run at the end) -> the same shape, int64."""
    d = doc_ids if doc_ids.dim() == 2 else doc_ids[None]
    t = torch.arange(d.shape[1], device=d.device).expand_as(d)
    first = torch.ones_like(d, dtype=torch.bool)
    first[:, 1:] = d[:, 1:] != d[:, :-1]
    start = torch.where(first, t, 0).cummax(dim=1).values
    return start if doc_ids.dim() == 2 else start[0]


def ttt_document_mask(step, seq_len: int, doc_ids: torch.Tensor, kv_stride: int | None = None):
    """ttt_mask over packed rows (step: as there): the TTT mask and the same document (doc_ids [T] or [B, T],
    labels per query position, at least seq_len long, each document one contiguous run). Only the
    step-0 keys can cross a boundary (the later steps' keys sit at the query's own position), and
    with contiguous documents "key j in q's document" is "j >= the start of q's document": the mask
    reads one start per query and gathers nothing at the key index. (A label gathered at
    kv_idx % stride, same_document's form, made the first packed training step on the H200 spend
    minutes in inductor compiling flex's backward: experiments/pack_probe.sh, 2026-12-01.)"""
    stride = seq_len if kv_stride is None else kv_stride
    assert stride >= seq_len
    start = _per_row(document_starts(doc_ids))

    def ttt_doc(b, h, q_idx, kv_idx):
        s = kv_idx // stride
        j = kv_idx - s * stride  # position of the key inside its step
        return ((s == 0) & (j <= q_idx) & (j >= start(b, q_idx))) | ((s > 0) & (s <= step) & (j == q_idx))

    return ttt_doc


def dflash_mask(
    ctx_len: int, block_size: int, anchors: torch.Tensor, window: int | None = None, starts: torch.Tensor | None = None
):
    """DFlash block-diffusion mask.

    Keys: [context (ctx_len) | block 0 (block_size) | block 1 | ... | block n-1],
    KV_LEN = ctx_len + n * block_size. Queries: the block tokens only,
    q_idx in [0, n * block_size) (block b = q_idx // block_size).
    anchors [n] or [B, n] (int): block b is anchored at context position anchors[b]; its tokens
    see context keys j < anchor (with `window`, only anchor - window <= j < anchor) and every
    token of their own block (bidirectional); never another block. An invalid block (anchor
    <= 0) still sees itself, so its rows stay finite; give it zero loss weight.
    starts [n] or [B, n] (int, packed rows): where block b's document starts in the row; its
    context keys are then also j >= starts[b] (its own document only).
    """
    anchor = _per_row(anchors)
    start = _per_row(starts) if starts is not None else None

    def dflash(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        a = anchor(b, blk)
        is_ctx = kv_idx < ctx_len
        ctx_ok = kv_idx < a
        if window is not None:
            ctx_ok = ctx_ok & (kv_idx >= a - window)
        if start is not None:
            ctx_ok = ctx_ok & (kv_idx >= start(b, blk))
        own_block = (kv_idx - ctx_len) // block_size == blk
        return (is_ctx & ctx_ok) | (~is_ctx & own_block)

    return dflash


def peagle_mask(pos: torch.Tensor, depth: torch.Tensor, doc_ids: torch.Tensor | None = None):
    """P-EAGLE parallel-drafting mask over one flattened sequence of L elements.

    Layout (all [L] or [B, L] int): the depth-0 elements (the ordinary sequence) come first or
    anywhere, followed by the rollouts; element a carries
      pos[a]   : for depth 0 its own position; for depth d > 0 the anchor position p of the
                 rollout it belongs to (it predicts the token d places after p's own target),
      depth[a] : 0 .. D-1,
      doc[a]   : document id (packing); negative = padding (sees nothing).
    Depth-0 elements attend to depth-0 elements of the same document at positions <= their
    own. An element of depth d > 0 attends to depth-0 elements at positions <= p and to the
    elements of its own rollout (same document, same p, 0 < depth <= d). Order in the
    flattened sequence does not matter to the mask, only these labels.
    """
    p, d = _per_row(pos), _per_row(depth)
    doc = _per_row(doc_ids) if doc_ids is not None else None

    def peagle(b, h, q_idx, kv_idx):
        p_q, p_k, d_q, d_k = p(b, q_idx), p(b, kv_idx), d(b, q_idx), d(b, kv_idx)
        to_base = (d_k == 0) & (p_k <= p_q)
        own_rollout = (d_q > 0) & (d_k > 0) & (p_k == p_q) & (d_k <= d_q)
        ok = to_base | own_rollout
        if doc is not None:
            doc_q = doc(b, q_idx)
            ok = ok & (doc_q == doc(b, kv_idx)) & (doc_q >= 0)
        return ok

    return peagle


def slot_mask(valid_BS: torch.Tensor, new_valid_BT: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Dense bool mask [B, 1, T, S + T] for decoding many prompts over shared cache slots (core/batched_chain.py):
    query t of row b sees b's valid old slots [B, S], and of the T new slots those that are valid and, when causal,
    <= t (a padding query still sees its own new slot, so no row is empty); not causal: every new slot (a DFlash
    block attends to itself both ways)."""
    B, T = new_valid_BT.shape
    dev = valid_BS.device
    see = torch.ones(T, T, dtype=torch.bool, device=dev)
    if causal:
        see = see.tril()
    new = see[None] & (new_valid_BT[:, None, :] | torch.eye(T, dtype=torch.bool, device=dev)[None])
    return torch.cat([valid_BS[:, None, :].expand(B, T, -1), new], -1)[:, None]


def mask_grid(mask_mod, B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> torch.Tensor:
    """Element-level boolean mask [B, H, Q_LEN, KV_LEN] by evaluating mask_mod on broadcast
    index grids (no vmap). Memory is B*H*Q*KV bytes: for tests and small shapes."""
    ar = lambda n: torch.arange(n, device=device)  # noqa: E731
    b = ar(B)[:, None, None, None]
    h = ar(H)[None, :, None, None]
    q = ar(Q_LEN)[None, None, :, None]
    kv = ar(KV_LEN)[None, None, None, :]
    return mask_mod(b, h, q, kv).expand(B, H, Q_LEN, KV_LEN)


def dense_attention(q, k, v, mask: torch.Tensor | None, scale: float | None = None):
    """Reference attention with a boolean mask broadcastable to [B, Hq, Q, KV].

    q [B, Hq, Q, D], k/v [B, Hkv, KV, D] (GQA by repeating kv heads). Softmax in fp32; rows
    with no allowed key give 0 (flex's convention) instead of NaN.
    """
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.float()).to(q.dtype)
