"""Continuous-batching generation with the compiled target's layers (models/fast_target.py):
what `capture.py regenerate` runs on a GPU to rewrite a dataset's answers with the target.

Why not `model.generate`: an HF batch runs until its longest row stops (rows that stopped early
idle), left padding recomputes nothing useful, and every token syncs the host for its stopping
check. Here a fixed set of `slots` shares one KV cache [slots, Hkv, L, D] per layer:
  * a request (prompt token ids) is prefilled into a free slot (a batch of new prompts at once,
    right-padded, causal SDPA: padding only ever follows the valid tokens, so it is never seen);
  * one decode step advances every slot by one token (q [S, Hkv, G, D] against its own cache,
    masked to its own length: no KV copy per query head);
  * the host knows every slot's length without asking the device (prompt length + steps), and
    reads the device only every `sync_every` steps: which slots stopped (EOS or max_new_tokens);
    finished slots are emptied and refilled with waiting prompts at once.
A slot that stopped between two syncs decodes a few wasted tokens, cut off at the first stop
token when it is read back. Under greedy decoding the output equals the target's own greedy
decoding (tests/test_generate.py against HF `generate`).

On CUDA the decode step's device work (30 layers of SmolLM2 are ~1,350 small kernels, which
eager Python launches slower than the GPU runs them) is replayed from a CUDA graph (`cuda_graphs`).
Everything the graph reads lives in buffers that are only ever written in place (tok, pos, the
caches), so a replay sees the current state; sampling and the per-slot bookkeeping stay eager (a
few kernels) so that any sampler works unchanged.

Decode attention reads the KV cache, most of a step's bytes. Two ways (`flex`):
  * flex (default on CUDA): the whole step compiled, attention through FlexAttention with a block
    mask of each slot's own length: slot s reads only its first pos[s] // 128 + 1 blocks of 128
    positions, whatever the other slots' lengths, and no score tensor is materialised. The G query
    heads that share a KV head are passed as G queries of that head (not enable_gqa), so that
    inductor picks its decoding kernel (one block reads a KV head once for all G queries; with
    enable_gqa it needs G a power of two, and SmolLM2 has G = 3). One graph covers every length.
  * plain: matmul, masked softmax, matmul over the prefix L every slot shares (the longest slot's
    length, rounded up to a bucket of 128; one graph per bucket): the reference, and the CPU path
    (no compile needed).

Prefills run eagerly between decode steps, each batch a new shape [n, P]. Two things there kept the
H200 waiting (experiments/results/scale_h200/gen_host/: the loop's host spent 9.7 of 15 s refilling
slots): SDPA's cuDNN backend plans each new shape again (2.2 ms of host time per layer), so prefill
attention asks for the flash / memory-efficient / math kernels; and a copy from pageable host memory
first waits for every queued decode step, so the prompts go through pinned memory.
"""

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from models.fast_target import FastTarget
from models.layers import merge_heads


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


GREEDY = Sampling()
BLOCK = 128  # cache positions per block: the plain path's length bucket, the flex path's mask block
# prefill attention: every kernel but cuDNN's, which plans each new [n, P] again on the host
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def length_block_mask(pos_S: torch.Tensor, G: int, L: int) -> BlockMask:
    """Slot s's G queries see cache positions 0..pos[s]: blocks past pos[s] // BLOCK are never read,
    the last one is masked per position. L: the cache length, a multiple of BLOCK."""
    S, n = pos_S.shape[0], L // BLOCK
    blocks = (pos_S // BLOCK + 1).to(torch.int32).view(S, 1, 1)  # [S, H=1, Q blocks=1]
    order = torch.arange(n, dtype=torch.int32, device=pos_S.device).expand(S, 1, 1, n)
    return BlockMask.from_kv_blocks(
        blocks, order.contiguous(), BLOCK_SIZE=BLOCK, mask_mod=lambda b, h, q, kv: kv <= pos_S[b], seq_lengths=(G, L)
    )


def flex_decode(q_SHqD, k_SHkvLD, v_SHkvLD, block_mask: BlockMask):
    """One query per slot and head [S, Hq, 1, D] against its cache [S, Hkv, L, D] -> [S, Hq, 1, D]
    (query head h reads KV head h // G, as enable_gqa would). Called inside the compiled decode step,
    which compiles flex_attention with it."""
    S, Hkv, _, D = k_SHkvLD.shape
    qg = q_SHqD.reshape(S, Hkv, -1, D)  # [S, Hkv, G, D]: G queries per KV head
    return flex_attention(qg, k_SHkvLD, v_SHkvLD, block_mask=block_mask).reshape(q_SHqD.shape)


def sample(logits_SV: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """Next token per row [S] from fp32 logits [S, V] (greedy, or temperature / top-k / top-p,
    the filters applied in HF's order: temperature, top-k, top-p)."""
    if s.temperature <= 0:
        return logits_SV.argmax(-1)
    x = logits_SV / s.temperature
    if s.top_k > 0:
        kth = x.topk(min(s.top_k, x.shape[-1]), dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) >= s.top_p  # keep the smallest prefix whose mass reaches top_p
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return torch.multinomial(x.softmax(-1), 1, generator=gen).squeeze(-1)


class SlotGenerator:
    """generator.add(key, prompt_ids) queues a request; generator.step() runs until at least one
    request finishes (or none is left) and returns [(key, new_token_ids, hit_max_new_tokens)]:
    the tokens before the first stop token, and whether max_new_tokens ran out first."""

    def __init__(
        self,
        target: FastTarget,
        slots: int,
        max_prompt_len: int,
        max_new_tokens: int,
        stop_ids,
        sampling: Sampling = GREEDY,
        seed: int = 0,
        sync_every: int = 16,
        prefill_tokens: int = 65536,
        cuda_graphs: bool | None = None,
        flex: bool | None = None,
    ):
        """cuda_graphs: replay each decode step from a CUDA graph; flex: decode attention through
        compiled FlexAttention over each slot's own length (both None = on CUDA devices)."""
        c = target.config
        self.t, self.S, self.max_new, self.sync_every = target, slots, max_new_tokens, sync_every
        self.max_prompt, self.prefill_tokens, self.sampling = max_prompt_len, prefill_tokens, sampling
        dev, dt = target.lm_head.weight.device, target.lm_head.weight.dtype
        self.dev = dev
        self.flex = flex if flex is not None else dev.type == "cuda"
        # the flex path compiles the whole step (one length: one compile); inductor fuses the norms,
        # rope and residual adds that eager runs as ~100 small kernels per layer
        self._step = torch.compile(self._step_logits, dynamic=False) if self.flex else self._step_logits
        # a slot may run sync_every - 1 steps past its end; whole blocks for the flex mask
        self.L = -(-(max_prompt_len + max_new_tokens + sync_every) // BLOCK) * BLOCK
        shape = (slots, c.num_key_value_heads, self.L, c.head_dim)
        n_layers = len(target.model.layers)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(n_layers)]
        self.stop = torch.tensor(sorted(set(stop_ids)), device=dev)
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.tok = torch.zeros(slots, dtype=torch.long, device=dev)  # last sampled token per slot
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)  # its position (= tokens in cache)
        self.out = torch.zeros(slots, max_new_tokens + sync_every, dtype=torch.long, device=dev)
        self.stopped = torch.ones(slots, dtype=torch.bool, device=dev)
        self.active = torch.zeros(slots, dtype=torch.long, device=dev)  # 1 = holds a request
        self.n_dev = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens in self.out[s]
        # host mirrors: no device read needed to know lengths. A request prefilled at decode step
        # `born` holds 1 + (steps - born) tokens in self.out and sits at position plen + steps - born.
        self.key: list = [None] * slots
        self.born = [0] * slots
        self.plen = [0] * slots
        self.waiting: deque = deque()
        self.steps = 0
        # cache positions read, summed over decode steps (experiments/gen_bench.py): S * L per plain
        # step; on the flex path each slot's whole blocks, counted on the device (no sync per step)
        self._kv_read = 0
        self._kv_read_dev = torch.zeros((), dtype=torch.long, device=dev)
        # cache length -> (graph, its logits output [S, V]); None = eager decode steps
        self.graphs = {} if (cuda_graphs if cuda_graphs is not None else dev.type == "cuda") else None
        self._pool = None  # one memory pool for all graphs (they never run at the same time)

    def add(self, key, prompt_ids: list[int], front: bool = False):
        """Queue a request (front=True: ahead of the others, e.g. a conversation's next turn)."""
        if not 0 < len(prompt_ids) <= self.max_prompt:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens (1..{self.max_prompt} allowed)")
        (self.waiting.appendleft if front else self.waiting.append)((key, list(prompt_ids)))

    def n_out(self, s: int) -> int:
        return 1 + self.steps - self.born[s]

    def host_pos(self, s: int) -> int:
        return self.plen[s] + self.steps - self.born[s]

    @property
    def kv_positions_read(self) -> int:
        return self._kv_read + int(self._kv_read_dev)

    def busy(self) -> bool:
        return bool(self.waiting) or any(k is not None for k in self.key)

    def _queued(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, the copy queued behind the decode steps (from pageable memory
        the host would first wait for all of them)."""
        return t.pin_memory().to(self.dev, non_blocking=True) if self.dev.type == "cuda" else t.to(self.dev)

    # ---- the model: FastTarget's modules, with a KV cache -------------------------------------
    def _logits(self, h_NH):
        return self.t.lm_head(self.t.model.norm(h_NH)).float()

    @torch.no_grad()
    def _prefill(self, slots: list[int], prompts: list[list[int]]):
        """Right-padded prompts [n, P] into their slots' caches; samples each first token."""
        n, P = len(prompts), max(map(len, prompts))
        ids = torch.zeros(n, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids, sl, lens = (self._queued(t) for t in (ids, torch.tensor(slots), torch.tensor(list(map(len, prompts)))))
        h = self.t.model.embed_tokens(ids)
        cos, sin = self.t.rope(torch.arange(P, device=self.dev).expand(n, P), h.dtype)
        for i, layer in enumerate(self.t.model.layers):
            a = layer.self_attn
            q, k, v = a.project(layer.input_layernorm(h), cos, sin)
            self.k[i][sl, :, :P], self.v[i][sl, :, :P] = k, v
            with sdpa_kernel(PREFILL_SDPA):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
            h = h + a.o_proj(merge_heads(o))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = h[torch.arange(n, device=self.dev), lens - 1]  # [n, H]
        tok = sample(self._logits(last), self.sampling, self.gen)
        self.tok[sl], self.pos[sl], self.out[sl, 0] = tok, lens, tok
        self.stopped[sl] = torch.isin(tok, self.stop)
        self.active[sl], self.n_dev[sl] = 1, 1
        for s, p in zip(slots, prompts):
            self.born[s], self.plen[s] = self.steps, len(p)

    def _step_logits(self, L: int) -> torch.Tensor:
        """The device work of one decode step over the first L cache positions: every slot's token
        `tok` written into the caches at `pos`, logits [S, V] fp32 of the next token. It only reads
        tok and pos and writes the caches at pos, so running it twice is the same as once (a CUDA
        graph's warm-up run relies on that)."""
        S = self.S
        h = self.t.model.embed_tokens(self.tok[:, None])  # [S, 1, H]
        cos, sin = self.t.rope(self.pos[:, None], h.dtype)
        rows = torch.arange(S, device=self.dev)
        if self.flex:
            c = self.t.config
            mask = length_block_mask(self.pos, c.num_attention_heads // c.num_key_value_heads, L)
        else:
            visible = torch.arange(L, device=self.dev)[None] <= self.pos[:, None]  # [S, L]
        for i, layer in enumerate(self.t.model.layers):
            a = layer.self_attn
            q, k, v = a.project(layer.input_layernorm(h), cos, sin)  # q [S, Hq, 1, D]; k, v [S, Hkv, 1, D]
            self.k[i][rows, :, self.pos], self.v[i][rows, :, self.pos] = k[:, :, 0], v[:, :, 0]
            if self.flex:
                o = merge_heads(flex_decode(q, self.k[i], self.v[i], mask))  # [S, 1, Hq * D]
            else:
                K, V = self.k[i][:, :, :L], self.v[i][:, :, :L]  # [S, Hkv, L, D]
                Hkv, D = K.shape[1], K.shape[3]
                qg = q.view(S, Hkv, -1, D)  # [S, Hkv, G, D]: query heads grouped by their KV head
                att = (qg @ K.transpose(-1, -2)).float() * D**-0.5  # [S, Hkv, G, L]
                att = att.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
                o = (att.to(V.dtype) @ V).reshape(S, 1, -1)  # heads in q's order: kv head major
            h = h + a.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self._logits(h[:, 0])

    def _graph_logits(self, L: int) -> torch.Tensor:
        """_step_logits(L) replayed from its CUDA graph (captured on first use of this bucket)."""
        if L not in self.graphs:
            try:
                self.graphs[L] = self._capture(L)
            except RuntimeError as e:  # a driver or kernel that cannot be captured: eager from here on
                print(f"[generate] CUDA graph capture failed ({e}); decoding eagerly", flush=True)
                self.graphs = None
                return self._step(L)
        g, out = self.graphs[L]
        g.replay()
        return out  # valid until the next replay (graphs share one pool)

    def _capture(self, L: int):
        """One eager warm-up run on a side stream (as torch.cuda.graphs asks), then the capture."""
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream(self.dev))
        with torch.cuda.stream(side):
            self._step(L)  # warm-up (and the compile): writes the same cache entries the replay will
        torch.cuda.current_stream(self.dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = self._step(L)
        return g, out

    @torch.no_grad()
    def _decode(self):
        """One token for every slot (idle ones too: their results are never read)."""
        if self.flex:  # one length: the mask limits each slot to its own blocks
            L = self.L
            self._kv_read_dev += ((self.pos // BLOCK + 1) * BLOCK).sum()
        else:  # the prefix every slot shares (host-known: no device read)
            top = max((self.host_pos(s) for s in range(self.S) if self.key[s] is not None), default=0)
            L = min(self.L, (top // BLOCK + 1) * BLOCK)
            self._kv_read += self.S * L
        try:
            logits = self._step(L) if self.graphs is None else self._graph_logits(L)
        except Exception as e:  # a compile this machine cannot do: plain attention, eager step
            if not self.flex or self.steps > 0:
                raise
            print(f"[generate] flex decode attention failed ({type(e).__name__}: {e}); plain attention", flush=True)
            self.flex, self._step, self.graphs = False, self._step_logits, None if self.graphs is None else {}
            self._kv_read_dev.zero_()
            return self._decode()
        tok = sample(logits, self.sampling, self.gen)
        self.tok.copy_(tok)  # in place: a graph reads this buffer
        rows = torch.arange(self.S, device=self.dev)
        self.out[rows, self.n_dev.clamp(max=self.out.shape[1] - 1)] = tok
        self.stopped |= torch.isin(tok, self.stop)
        self.pos += self.active  # idle slots stay at 0 (their cache row is never read)
        self.n_dev += self.active
        self.steps += 1

    # ---- scheduling -----------------------------------------------------------------------------
    def _fill(self):
        free = [s for s in range(self.S) if self.key[s] is None]
        take = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        take.sort(key=lambda r: len(r[1]))  # similar lengths share a prefill batch (less padding)
        i = 0
        while i < len(take):
            j = i + 1
            while j < len(take) and (j + 1 - i) * len(take[j][1]) <= self.prefill_tokens:
                j += 1
            batch, slots = take[i:j], free[i:j]
            for s, (key, _) in zip(slots, batch):
                self.key[s] = key
            self._prefill(slots, [p for _, p in batch])
            i = j

    def _harvest(self) -> list:
        stopped = self.stopped.tolist()  # the one device read per sync_every steps
        done = [s for s in range(self.S) if self.key[s] is not None and (stopped[s] or self.n_out(s) >= self.max_new)]
        if not done:
            return []
        rows = self.out[torch.tensor(done, device=self.dev)].tolist()
        stop, res = set(self.stop.tolist()), []
        for s, row in zip(done, rows):
            row = row[: min(self.n_out(s), self.max_new)]
            cut = next((j for j, t in enumerate(row) if t in stop), None)
            res.append((self.key[s], row[:cut] if cut is not None else row, cut is None))
            self.key[s] = None
        d = torch.tensor(done, device=self.dev)
        self.stopped[d], self.active[d], self.pos[d], self.n_dev[d] = True, 0, 0, 0
        return res

    def step(self) -> list:
        """Decode until at least one request finishes; returns the finished ones."""
        while self.busy():
            self._fill()
            for _ in range(self.sync_every):
                self._decode()
            res = self._harvest()
            if res:
                return res
        return []
