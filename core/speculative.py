"""Speculative decoding of a Hugging Face target with a draft of any family (EAGLE-3 chain / tree,
P-EAGLE parallel proposals, DFlash block proposals; each family's proposer is in its models/ file),
in plain PyTorch: the
reference measurement of τ (tokens per target forward) that the serving engines are checked
against. Greedy only, batch 1, both models with KV caches.

One step (EAGLE-2/3 style; chain drafting is the tree with top-k 1):
  state     committed ids[0..N-1]; the target cache holds positions 0..N-2; the draft cache holds
            draft positions 0..N-2 (position t fed fc(aux_t) and embed(ids[t+1]), as in training)
            and `h_last`, its layer output at position N-2 (it predicts token N)
  draft     depth 1: top-k of logits(h_last); depth j+1: each depth-j node is fed (its token's
            embedding, its parent's output) at draft position N-2+j, attending the draft cache and
            its own ancestors (tree mask); of its top-k children the best k by summed log-prob
            over the whole depth are kept. Tree = k * depth nodes. With k = 1 this is vLLM's
            chain proposer: K drafts cost K draft forwards (one catch-up + K-1 steps).
  verify    one target forward over [ids[N-1]] + nodes at positions N-1 + depth, each attending
            the cache, the root and its ancestors; walk from the root following the child whose
            token equals the target's argmax; emit the path's tokens + the target's next token.
  commit    the target cache keeps the root and the path rows (gathered, in order); the draft
            cache drops its speculative entries and catches up over the committed positions
            with the target's aux hidden states of those rows (like vLLM's EAGLE proposer).
Because every emitted token is the target's own argmax, the output equals plain greedy decoding
(up to float ties).

Counters follow vLLM's (`vllm:spec_decode_*`): per verification step `drafts` += 1,
`draft_tokens` += tree depth, `accepted` += accepted path length, `accepted_per_pos[i]` += 1 if
the path reached depth i+1. τ = 1 + accepted / drafts = tokens per verification forward (the
prefill forward, which makes the first token, is not a verification step; a proposer that
sometimes proposes nothing, like n-gram lookup, counts those steps as drafts of 0 tokens so τ
stays tokens per forward: see DESIGN.md "Measuring τ").

Timings (wall clock, CUDA synchronized): `draft_seconds` = the proposer's propose() and commit()
(its catch-up over the verified rows) of every verification step, `target_seconds` = the
verification forwards; the prefill of either is not counted. The draft cost per verification step
relative to a target forward is c = draft_seconds / target_seconds, and the expected speed-up of
speculative decoding over plain greedy decoding is τ / (1 + c): a step costs one target forward plus
its drafting, (1 + c) target forwards, and emits τ tokens, where plain decoding emits one per target
forward (this takes a verification forward of K + 1 rows to cost one decoding forward of 1 row,
which holds while the target is launch- or weight-bandwidth-bound, as at batch 1).
"""

import inspect
import time
from dataclasses import dataclass, field

import torch

from models.families import FAMILIES
from models.proposer import Proposer, Tree


@dataclass
class SpecStats:
    prompts: int = 0
    new_tokens: int = 0  # tokens returned (after EOS / max_new_tokens truncation)
    target_forwards: int = 0  # prefills + verification steps
    drafts: int = 0  # verification steps
    proposed: int = 0  # verification steps with at least one draft token
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # wall-clock timings (module docstring): not part of what a decode is, so == ignores them
    draft_seconds: float = field(default=0.0, compare=False)  # propose + commit of the verification steps
    target_seconds: float = field(default=0.0, compare=False)  # the verification forwards (not the prefill)

    def add(self, o: "SpecStats"):
        for k in (
            "prompts",
            "new_tokens",
            "target_forwards",
            "drafts",
            "proposed",
            "draft_tokens",
            "accepted",
            "draft_seconds",
            "target_seconds",
        ):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        n = max(len(self.accepted_per_pos), len(o.accepted_per_pos))
        self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos + [0] * n, o.accepted_per_pos + [0] * n)][
            :n
        ]

    def add_step(self, depth: int, accepted: int, proposed: bool = True):
        """One verification step that drafted `depth` deep and accepted the first `accepted`."""
        self.target_forwards += 1
        self.drafts += 1
        self.proposed += int(proposed)
        self.draft_tokens += depth
        self.accepted += accepted
        if len(self.accepted_per_pos) < depth:
            self.accepted_per_pos += [0] * (depth - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    def summary(self) -> dict:
        d = max(self.drafts, 1)
        tau = 1 + self.accepted / d
        timed = self.target_seconds > 0  # core/batched_chain.py does not time its steps
        c = self.draft_seconds / self.target_seconds if timed else None
        return {
            "tau": tau,
            "acceptance_per_pos": [a / d for a in self.accepted_per_pos],
            "draft_acceptance_rate": self.accepted / max(self.draft_tokens, 1),
            # vLLM's `1 + accepted / num_drafts` counts only steps that proposed: it equals tau
            # for EAGLE (always proposes) and overstates it for n-gram lookup
            "tau_proposed_steps": 1 + self.accepted / max(self.proposed, 1),
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "draft_seconds": round(self.draft_seconds, 6) if timed else None,
            "target_seconds": round(self.target_seconds, 6) if timed else None,
            "draft_cost": c,  # draft seconds per verification step / target seconds per verification step
            "expected_speedup": tau / (1 + c) if timed else None,
        }


def cache_kwarg(model) -> str:
    """The name of an HF model's KV-cache argument (renamed in transformers 5.2x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TargetRunner:
    """An HF causal LM with a KV cache that can keep an arbitrary subset of its new rows, and
    the aux hidden states (outputs of `aux_layers`, HF hidden_states[i + 1]) of every row."""

    def __init__(self, model, aux_layers: list[int] | None = None):
        from transformers import DynamicCache  # lazy: transformers (~1.5 s) stays out of evaluate.py --help

        self.model, self.aux_layers = model.eval(), list(aux_layers or [])
        self._new_cache = lambda: DynamicCache(config=model.config)
        self._cache_kw = cache_kwarg(model)
        self.cache, self.length = None, 0

    def reset(self):
        self.cache, self.length = self._new_cache(), 0

    @torch.no_grad()
    def forward(self, ids: list[int], positions: list[int], tree_mask: torch.Tensor | None = None):
        """Run new rows against the cache. tree_mask: bool [T, T] among the new rows (None =
        causal). Returns logits [T, V] (fp32) and aux hidden [T, n_aux * H] (or None)."""
        dev = self.model.device
        T, L = len(ids), self.length
        kw = {self._cache_kw: self.cache}
        if tree_mask is not None:
            mask = torch.ones(1, 1, T, L + T, dtype=torch.bool, device=dev)
            mask[0, 0, :, L:] = tree_mask.to(dev)
            kw["attention_mask"] = mask
        out = self.model(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
            use_cache=True,
            output_hidden_states=bool(self.aux_layers),
            **kw,
        )
        self.length += T
        aux = torch.cat([out.hidden_states[i + 1][0] for i in self.aux_layers], -1) if self.aux_layers else None
        return out.logits[0].float(), aux

    def keep(self, n_prefix: int, rows: list[int]):
        """Keep the first n_prefix cache entries plus the new rows `rows` (offsets after the
        prefix, ascending), in that order."""
        idx = torch.tensor(list(range(n_prefix)) + [n_prefix + r for r in rows])
        if len(idx) == self.length and rows == list(range(len(rows))):
            return
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":  # sliding-window / linear-attention caches hold more state
                raise NotImplementedError(
                    f"speculative decoding needs plain KV caches, the target uses {type(layer).__name__}"
                )
            i = idx.to(layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(2, i), layer.values.index_select(2, i)
        self.length = len(idx)


class NgramProposer(Proposer):
    """Prompt lookup (Saxena 2023; vLLM's `ngram` method): find the most recent earlier
    occurrence of the longest suffix n-gram (max_n down to min_n) and propose the k tokens that
    followed it."""

    name = "ngram"

    def __init__(self, k: int, min_n: int = 1, max_n: int = 3):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, ids):
        n_ids = len(ids)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            suffix = ids[n_ids - n :]
            for start in range(n_ids - n - 1, -1, -1):
                if ids[start : start + n] == suffix:
                    follow = ids[start + n : start + n + self.k]
                    return Tree(follow, list(range(-1, len(follow) - 1)))
        return Tree()


def proposer_for(draft, model, depth: int | None = None, topk: int = 1) -> Proposer:
    """The PyTorch proposer of a draft (any family) for an HF target `model`. depth / topk apply
    to EAGLE-3 (chain of `depth`, or a top-k tree); the other families draft the K tokens they
    were trained for and verify the first `depth` <= K of them (None: all K)."""
    return FAMILIES[draft.family].proposer(draft, model, depth, topk)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":  # kernels run asynchronously: time what has finished
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def speculative_generate(
    target: TargetRunner, proposer: Proposer, prompt: list[int], max_new_tokens: int, eos_ids=()
) -> tuple[list[int], SpecStats]:
    """Greedy generation of up to max_new_tokens after prompt (stops after an EOS id)."""
    st = SpecStats(prompts=1)
    eos = set(eos_ids)
    target.reset()
    logits, aux = target.forward(prompt, list(range(len(prompt))))
    st.target_forwards += 1
    ids = list(prompt) + [int(logits[-1].argmax())]
    if proposer.needs_aux:
        proposer.prefill(ids, aux)
    dev = target.model.device
    while len(ids) - len(prompt) < max_new_tokens and ids[-1] not in eos:
        N = len(ids)
        t0 = _clock(dev)
        tree = proposer.propose(ids)
        t1 = _clock(dev)
        depths = tree.depths()
        mask = torch.ones(len(tree) + 1, len(tree) + 1, dtype=torch.bool).tril()
        if len(tree):
            mask[1:, 1:] = tree.ancestors_mask()
        logits, aux = target.forward(
            [ids[-1]] + tree.tokens, [N - 1] + [N - 1 + x for x in depths], mask if len(tree) else None
        )
        pred = logits.argmax(-1).tolist()
        t2 = _clock(dev)
        st.draft_seconds += t1 - t0
        st.target_seconds += t2 - t1
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p, []).append(i)
        path, cur = [], -1
        while True:
            nxt = [c for c in children.get(cur, []) if tree.tokens[c] == pred[cur + 1]]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        new = [tree.tokens[i] for i in path] + [pred[cur + 1]]
        st.add_step(max(depths, default=0), len(path), proposed=len(tree) > 0)
        rows = [0] + [1 + i for i in path]
        target.keep(N - 1, rows)
        ids += new
        if any(t in eos for t in new) or len(ids) - len(prompt) >= max_new_tokens:
            break
        if proposer.needs_aux:
            t0 = _clock(dev)
            proposer.commit(ids, aux[rows])
            st.draft_seconds += _clock(dev) - t0
    out = trim_output(ids[len(prompt) :], eos, max_new_tokens)
    st.new_tokens = len(out)
    return out, st


def trim_output(out: list[int], eos: set, max_new_tokens: int) -> list[int]:
    """The generated ids up to and including the first EOS, at most max_new_tokens (a step
    emits up to depth + 1 tokens, so it can run past either)."""
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1][:max_new_tokens]
    return out[:max_new_tokens]
