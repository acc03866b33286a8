"""Naive, slow, independent reference of the Batch-Max paper's algorithms.

Written from the paper (section 3: Algorithm 1, the average-attention eviction rule, Algorithm 3) and
docs/API.md only -- it deliberately shares no code with ``batchmax_tp``.

The forward pass of a HF ``LlamaForCausalLM``-style model (Llama, Qwen2, Mistral: same module layout; Phi-3's fused
``qkv_proj`` split into its queries, keys and values) is
re-run by hand from the model's own submodules, one sample at a time, token block by token block, with an
explicit eager attention over a Python list of kept KV entries per (layer, KV head).  Nothing is batched or
vectorised beyond single dot products, so that every rule is visible in a few lines:

* Schedule ("bm", Algorithm 1): s = padded length; first block t1 = min(s, kv_max); while t1 < s: evict p,
  process the next block of up to p tokens.  Decoding, t = 1..max_new_tokens-1: if |kv| == kv_max evict p;
  process the token at padded position s+t-1.  |kv| counts pad entries (pads occupy slots).
* Average attention: every query (one per query head per real token) attends causally over the kept
  entries plus the current block up to itself; the probability it gives an entry is added to that entry's
  sum (GQA: the g query heads of a group all add to their KV head's entries).  Pads are never attended and
  pad queries add nothing.  Eviction removes the p entries with the smallest
  ``(ave, position)`` where ``ave = sum / (curr_id + 1 - position)``, curr_id = last position already
  processed, and pads have ``ave = -inf``.
* "ed" (Algorithm 3): the prompt is one block, then only the newest entry is kept; during decoding, after a
  token is processed, if |kv| == kv_max only the newest entry is kept.  The reference applies each of these
  evictions lazily, just before the next decode step (step 1, or when |kv| == kv_max): every forward pass sees
  exactly the same pairs, and the state reported after the last token is the set of pairs that token attended
  (an eviction with no later step to serve is not applied -- BM is reported the same way).
* "fkv": the prompt is one block, nothing is ever evicted.
* "snap" (window, kernel; SnapKV's compression once after the prompt): the prompt is one block; each query among
  its last w = min(window, s) real tokens adds the probability it gives each entry to that entry's ``win`` (summed
  over the KV head's query heads). Then each (layer, KV head) with more than kv_max real entries keeps the last w
  entries and the kv_max - w others with the largest ``pooled`` = (sum of ``win`` over the non-window entries
  whose position is within kernel // 2 of its own) / kernel (SnapKV's average pooling, padding counted), ties to
  the older entry; pads are dropped. Every kept entry's ``sum`` becomes its ``win``. Decoding as "bm": if
  |kv| == kv_max evict p by ``(ave, position)`` before the step.

Eviction rules beside the paper's (``rule``, BM only; every parameter must be given in ``rule_params``, so the
reference has no defaults of its own):

* "paper": ``(ave, position)`` as above.
* "pooled" (kernel, pool): an entry's priority is the max ("max") or mean ("avg") of ``ave`` over the real kept
  entries whose position is within kernel // 2 of its own (itself included).
* "sinks" (sinks, recent): ``ave``, but +inf (never evicted) for real entries with real index
  (position - number of pads) < sinks or position > curr_id - recent.
* "probe" (window, every, weight): look-ahead probe. Every prefill block [t0, t1) with t1 < s is followed, in the same
  forward, by the prompt tokens at padded positions [max(t1, s - window), s) (their real RoPE positions); pads
  among them are dropped. A probe token's query attends to every real kept entry (the block included) and to
  the probe tokens up to itself; its key/value is never kept and its logits are not used. ``probe`` of each kept
  entry of that (layer, KV head) is then the probability it got from the probe queries, summed over the group's
  query heads and divided by the number of real probe tokens (0 if none). Prefill evictions use
  ``ave + weight * probe`` (the probe of the pass just before), decode evictions plain ``ave``.
  ``every`` (1: every block): only prefill blocks 0, every, 2*every, ... (counted from the first) carry the
  probe; the probe's queries and keys of the last probed block are kept, and a prefill eviction after a block
  without a probe first recomputes every kept entry's ``probe`` from them as above, over the entries kept then.
* "snapkv" (window, every, weight, kernel, pool): the probe's score, then pooled as in "pooled".
* "question" (window, every, kernel, pool, sinks, recent; ``decode`` optional): the probe as in "probe"; prefill
  evictions use ``probe`` alone, decode evictions ``ave``, either pooled as in "pooled", and then +inf for the entries
  "sinks" protects. ``decode="probe"``: a decode eviction first recomputes every kept entry's ``probe`` from the
  last probe's stored queries and keys (as a prefill eviction after an unprobed block does) and ranks by it as a
  prefill eviction does; a sample that never probed ranks by ``ave`` still. ``recall="tier"``: every entry a prefill
  eviction removes is set aside (with its ``sum``), and the eviction before the prompt's last block ranks the kept
  entries and the set-aside ones together (``probe`` of all of them recomputed from the stored queries and keys over
  all of them), removing the p + (set-aside) lowest; the others are the kept entries from then on.
  ``recall="window"``: every entry a prefill eviction removes is set aside, and after the prompt's last block each
  (layer, KV head) that set some aside chooses from the kept and the set-aside real entries together, as "snap" does
  (below) with the prompt's last w = min(window, entries, kept) real queries as computed in the run (each layer's
  queries, kept as its blocks ran): each adds the probability it gives each of those entries at or before its own
  position (one softmax over all of them) to the entry's window score; the last w entries and the (kept - w) others
  of largest pooled window score (over the non-window entries within kernel // 2, "max" or "avg" as "snap": the
  sum / kernel; +inf for the entries "sinks" protects, its first ``sinks`` and ``recent`` newest), ties to the older,
  are the kept entries from then on (as many real ones as were kept; pads stay).

Heads sharing one budget (``groups``, BM; the rule parameter ``share``): a group of heads holds
``len(group) * kv_max`` entries together, counted per head as ``|kv|`` = the group's entries / its heads; an eviction
removes ``len(group) * p`` of them, those with the smallest ``(priority, position, head)``, each entry's priority
computed within its own head as above.

Budgets across layers (``layer_kv_max``, BM; the rule parameter ``taper``): layer l holds at most ``layer_kv_max[l]``
entries per head. The first block is ``min(s, min(layer_kv_max))`` tokens, then blocks of p; before each later block,
and before each decode step, every layer whose entries and the incoming tokens exceed its own budget evicts p of
them as above (the other layers evict nothing then).

Positions (``kept`` and ``curr_id``) are indices in the padded sequence: prompt 0..s-1, the token fed at
decode step t is s+t-1.  RoPE uses the sample's real position ids (cumsum(mask)-1), like HF ``generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb


@dataclass
class Entry:
    """One kept KV pair of one (sample, layer, KV head)."""

    pos: int  # index in the padded sequence
    is_pad: bool
    key: torch.Tensor | None = None  # [head_dim], post-RoPE (None for pads)
    value: torch.Tensor | None = None  # [head_dim]
    sum: float = 0.0  # summed attention weight received (python float = float64)
    probe: float = 0.0  # look-ahead probe attention of the last probed pass (probe rules)
    win: float = 0.0  # attention from the prompt's observation window ("snap")


@dataclass
class RefResult:
    logits: list  # list over generated tokens of float32 [B, V]
    kept: list  # [layer][sample][kv_head] -> sorted list[int] (real positions only) after the last pass
    tokens: torch.Tensor  # [B, max_new_tokens]
    kept_after_prefill: list = field(default_factory=list)  # same layout, right after the prompt
    kept_history: list = field(default_factory=list)  # [t] -> kept (same layout) after producing logits[t]
    evictions: int = 0  # number of eviction events (summed over samples, layers, heads)
    min_margin: float = math.inf  # smallest nonzero relative gap between the last evicted and first kept ave
    tie_decisions: int = 0  # evictions whose boundary was an exact ave tie (decided by position)
    events: list = field(default_factory=list)  # (sample, layer, head, curr_id, evicted positions)

    def __iter__(self):  # allows ``logits, kept, tokens = reference_generate(...)``
        return iter((self.logits, self.kept, self.tokens))


def _decoder_modules(model):
    base = model.model
    return base.embed_tokens, base.layers, base.rotary_emb, base.norm, model.lm_head


class _SampleState:
    """The kept entries of one sample: kv[layer][kv_head] -> list[Entry] (ordered by position)."""

    def __init__(self, model, npad: int, groups=None):
        cfg = model.config
        self.model = model
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.group = self.n_heads // self.n_kv
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.npad = npad
        self.kv = [[[] for _ in range(self.n_kv)] for _ in range(self.n_layers)]
        self.groups = groups or [[h] for h in range(self.n_kv)]  # KV heads sharing one budget (Rule.share)
        self.probe_qk = [None] * self.n_layers  # per layer: (q [Hq, m, D], k [Hkv, m, D]) of the last probe
        self.aside = [[[] for _ in range(self.n_kv)] for _ in range(self.n_layers)]  # recall="tier": evicted entries
        self.probed = False  # the last processed block carried the probe
        self.window_q = None  # recall="window": per layer the last real queries so far, [(position, q [Hq, D])]
        self.window_keep = 0

    # ------------------------------------------------------------------ forward of one block
    def process(self, block, probe=(), window=0):
        """block: list of (padded position, token id); probe: the look-ahead probe tokens (same form) that ride
        along (never kept); window: the block's last ``window`` real queries add their attention to the entries'
        ``win``. Returns the float32 logits of the block's last token (None if it holds only pads)."""
        embed, layers, rotary, norm, lm_head = _decoder_modules(self.model)
        real = [(pos, tok) for pos, tok in block if pos >= self.npad]
        pads = [pos for pos, _ in block if pos < self.npad]
        probe = [(pos, tok) for pos, tok in probe if pos >= self.npad]  # pad probe tokens do not exist
        self.probed = bool(probe)
        assert [pos for pos, _ in block] == sorted(pos for pos, _ in block)
        if not real and not probe:  # only pads: they just occupy slots
            for layer in range(self.n_layers):
                for h in range(self.n_kv):
                    self.kv[layer][h].extend(Entry(pos, True) for pos in pads)
            return None
        positions = [pos for pos, _ in real]
        n, m = len(real), len(probe)
        ids = torch.tensor([[tok for _, tok in real + probe]])
        pos_ids = torch.tensor([[pos - self.npad for pos, _ in real + probe]])  # real RoPE positions
        hidden = embed(ids)  # [1, n + m, hidden]
        cos, sin = rotary(hidden, pos_ids)
        for layer, dec in enumerate(layers):
            attn = dec.self_attn
            residual = hidden
            x = dec.input_layernorm(hidden)
            if hasattr(attn, "qkv_proj"):  # Phi-3: one fused projection, queries then keys then values
                qd, kd = self.n_heads * self.head_dim, self.n_kv * self.head_dim
                qkv = attn.qkv_proj(x)
                q, k, v = qkv[..., :qd], qkv[..., qd : qd + kd], qkv[..., qd + kd :]
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            q = q.reshape(1, n + m, self.n_heads, self.head_dim).transpose(1, 2)
            k = k.reshape(1, n + m, self.n_kv, self.head_dim).transpose(1, 2)
            v = v.reshape(1, n + m, self.n_kv, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if self.window_q is not None:  # recall="window": the prompt's last real queries, as computed
                mine = self.window_q[layer] + [(pos, q[0, :, i].clone()) for i, pos in enumerate(positions)]
                self.window_q[layer] = mine[-self.window_keep :]
            if probe:
                self.probe_qk[layer] = (q[0, :, n:].clone(), k[0, :, n:].clone())
            out = torch.zeros(n + m, self.n_heads, self.head_dim, dtype=hidden.dtype)
            for h in range(self.n_kv):
                entries = self.kv[layer][h]
                entries.extend(Entry(pos, True) for pos in pads)
                entries.extend(
                    Entry(pos, False, k[0, h, i].clone(), v[0, h, i].clone()) for i, pos in enumerate(positions)
                )
                for qh in range(h * self.group, (h + 1) * self.group):  # the query heads of this KV head
                    for i, qpos in enumerate(positions):
                        visible = [e for e in entries if not e.is_pad and e.pos <= qpos]
                        keys = torch.stack([e.key for e in visible])
                        values = torch.stack([e.value for e in visible])
                        scores = (keys @ q[0, qh, i]) * self.scaling
                        probs = torch.softmax(scores.float(), dim=-1)
                        out[i, qh] = probs.to(values.dtype) @ values
                        for e, pr in zip(visible, probs.tolist()):
                            e.sum += pr
                            if i >= n - window:
                                e.win += pr
                if probe:  # probe queries: all real kept entries, then the probe tokens up to themselves
                    kept, rows = self.probe_attention(layer, h)
                    for qh, i, probs in rows:
                        values = torch.stack([e.value for e in kept] + [v[0, h, n + j] for j in range(i + 1)])
                        out[n + i, qh] = probs.to(values.dtype) @ values
            hidden = residual + attn.o_proj(out.reshape(1, n + m, self.n_heads * self.head_dim))
            residual = hidden
            hidden = residual + dec.mlp(dec.post_attention_layernorm(hidden))
        hidden = norm(hidden)
        return lm_head(hidden[:, n - 1]).float()[0] if real else None

    def probe_attention(self, layer, h, entries=None):
        """Sets ``probe`` of the kept entries of (layer, KV head h) (or of ``entries``) from the stored probe queries
        and keys. Returns (the real entries, [(query head, probe index, probabilities over those entries + own keys up
        to it)])."""
        q, k = self.probe_qk[layer]
        m = k.shape[1]
        entries = self.kv[layer][h] if entries is None else entries
        kept = [e for e in entries if not e.is_pad]
        for e in entries:
            e.probe = 0.0
        rows = []
        for qh in range(h * self.group, (h + 1) * self.group):
            for i in range(m):
                keys = torch.stack([e.key for e in kept] + [k[h, j] for j in range(i + 1)])
                probs = torch.softmax(((keys @ q[qh, i]) * self.scaling).float(), dim=-1)
                for e, pr in zip(kept, probs.tolist()):
                    e.probe += pr / m
                rows.append((qh, i, probs))
        return kept, rows

    # ------------------------------------------------------------------ evictions
    def size(self, layers=None) -> int:
        """Entries per head of ``layers`` (default all): with heads sharing a budget (``groups``), a group's entries
        over its heads."""
        kv = self.kv if layers is None else [self.kv[i] for i in layers]
        sizes = {sum(len(layer[h]) for h in group) / len(group) for layer in kv for group in self.groups}
        assert len(sizes) == 1, sizes
        return int(sizes.pop())

    def evict_bm(
        self,
        p: int,
        curr_id: int,
        result: RefResult,
        sample: int,
        rule: str = "paper",
        params: dict | None = None,
        prefill: bool = False,
        layers=None,
        last: bool = False,
    ):
        """Each (layer of ``layers``, default all; group of heads sharing a budget) evicts len(group) * p entries, the
        lowest ``(priority, position, head)`` over the group's heads (each entry's priority computed within its own
        head). ``recall="tier"``: a prefill eviction sets its entries aside; ``last`` (before the prompt's last
        block) ranks the set-aside entries with the kept ones and removes them as well."""
        params = params or {}
        aside = prefill and rule == "question" and params.get("recall") in ("tier", "window")
        recall = aside and last and params.get("recall") == "tier"
        for layer in range(self.n_layers) if layers is None else layers:
            ranked = {}  # head -> [(priority, position, head, entry)]
            asked = rule == "question" and params.get("decode") == "probe" and self.probe_qk[layer] is not None
            for h in range(self.n_kv):
                if recall:  # the kept and the set-aside entries together, re-scored from the stored probe
                    self.kv[layer][h] = sorted(self.kv[layer][h] + self.aside[layer][h], key=lambda e: e.pos)
                    removed, self.aside[layer][h] = len(self.aside[layer][h]), []
                    self.probe_attention(layer, h)
                elif (prefill and not self.probed or asked) and self.probe_qk[layer] is not None:  # re-score: stored
                    self.probe_attention(layer, h)
                ranked[h] = self.priorities(self.kv[layer][h], h, curr_id, rule, params, prefill or asked)
            for group in self.groups:
                n = p * len(group) + (removed * len(group) if recall else 0)
                order = sorted(item for h in group for item in ranked[h])
                assert len(order) >= n
                evicted, kept = order[:n], order[n:]
                real_ev = [item for item in evicted if not item[3].is_pad]
                if real_ev and kept and math.isfinite(kept[0][0]):  # how close the decision was
                    a, b = real_ev[-1][0], kept[0][0]
                    assert math.isfinite(a), "a protected entry was evicted"
                    if a == b:  # an exact tie at the boundary: decided by position (older evicted)
                        result.tie_decisions += 1
                    else:  # a near tie would be decided by rounding noise
                        result.min_margin = min(result.min_margin, (b - a) / max(abs(b), 1e-30))
                gone = {id(item[3]) for item in evicted}
                for h in group:
                    if aside and not recall:
                        self.aside[layer][h].extend(e for e in self.kv[layer][h] if id(e) in gone)
                    self.kv[layer][h] = [e for e in self.kv[layer][h] if id(e) not in gone]  # compacted
                    result.evictions += 1
                    ev = sorted(item[1] for item in real_ev if item[2] == h)
                    result.events.append((sample, layer, h, curr_id, ev))

    def priorities(self, entries, h, curr_id, rule, params, prefill):
        """[(priority, position, head, entry)] of one (layer, head)'s entries under ``rule``."""

        def average(e):
            assert e.pos <= curr_id
            return -math.inf if e.is_pad else e.sum / (curr_id + 1 - e.pos)

        def base(e):
            if rule in ("probe", "snapkv") and prefill and not e.is_pad:
                return average(e) + params["weight"] * e.probe
            if rule == "question" and prefill and not e.is_pad:
                return e.probe
            return average(e)

        def protected(e):
            return e.pos - self.npad < params["sinks"] or e.pos > curr_id - params["recent"]

        def ave(e):  # the rule's priority
            if e.is_pad or rule in ("paper", "probe"):
                return base(e)
            if rule == "question" and protected(e):
                return math.inf
            if rule in ("pooled", "snapkv", "question"):
                r = params["kernel"] // 2
                near = [base(o) for o in entries if not o.is_pad and abs(o.pos - e.pos) <= r]
                return max(near) if params["pool"] == "max" else sum(near) / len(near)
            assert rule == "sinks", rule
            if protected(e):
                return math.inf
            return average(e)

        return [(ave(e), e.pos, h, e) for e in entries]

    def snap(self, kv_max: int, window: int, kernel: int):
        """SnapKV's choice after the prompt (module docstring): the window and the best-pooled others stay."""
        for layer in range(self.n_layers):
            for h in range(self.n_kv):
                real = [e for e in self.kv[layer][h] if not e.is_pad]
                if len(real) > kv_max:
                    w = min(window, len(real))
                    prefix, recent = real[: len(real) - w], real[len(real) - w :]
                    r = kernel // 2

                    def pooled(e):
                        return sum(o.win for o in prefix if abs(o.pos - e.pos) <= r) / kernel

                    best = sorted(prefix, key=lambda e: (-pooled(e), e.pos))[: kv_max - w]
                    real = sorted(best, key=lambda e: e.pos) + recent
                for e in real:
                    e.sum = e.win
                self.kv[layer][h] = real

    def choose_by_window(self, window: int, params: dict, curr_id: int, result: RefResult):
        """recall="window" after the prompt's last block (module docstring): from the kept and the set-aside entries,
        the window and the best-pooled others by the window queries' attention over all of them."""
        for layer in range(self.n_layers):
            for h in range(self.n_kv):
                pads = [e for e in self.kv[layer][h] if e.is_pad]
                held = [e for e in self.kv[layer][h] if not e.is_pad]
                union = sorted(held + [e for e in self.aside[layer][h] if not e.is_pad], key=lambda e: e.pos)
                self.aside[layer][h] = []
                if len(union) == len(held):
                    continue
                w = min(window, len(union), len(held))
                win = {id(e): 0.0 for e in union}
                for qpos, q in self.window_q[layer][-w:]:
                    visible = [e for e in union if e.pos <= qpos]
                    keys = torch.stack([e.key for e in visible])
                    for qh in range(h * self.group, (h + 1) * self.group):
                        probs = torch.softmax(((keys @ q[qh]) * self.scaling).float(), dim=-1)
                        for e, pr in zip(visible, probs.tolist()):
                            win[id(e)] += pr
                prefix, recent = union[: len(union) - w], union[len(union) - w :]
                kernel, r = params["kernel"], params["kernel"] // 2

                def pooled(e):
                    if e.pos - self.npad < params["sinks"] or e.pos > curr_id - params["recent"]:
                        return math.inf  # the rule's sinks and recent pairs
                    near = [win[id(o)] for o in prefix if abs(o.pos - e.pos) <= r]
                    return max(near) if params["pool"] == "max" else sum(near) / kernel

                order = sorted(prefix, key=lambda e: (-pooled(e), e.pos))
                best = order[: len(held) - w]
                if best and len(order) > len(best):  # how close the choice was at its boundary
                    a, b = pooled(best[-1]), pooled(order[len(best)])
                    if a == b or math.isinf(a):  # (protected pairs: kept first, by position)
                        result.tie_decisions += 1
                    else:
                        result.min_margin = min(result.min_margin, (a - b) / max(abs(a), 1e-30))
                self.kv[layer][h] = pads + sorted(best, key=lambda e: e.pos) + recent

    def keep_newest(self, result: RefResult, sample: int, curr_id: int):
        for layer in range(self.n_layers):
            for h in range(self.n_kv):
                entries = self.kv[layer][h]
                newest = max(entries, key=lambda e: e.pos)
                assert newest.pos == curr_id
                result.events.append(
                    (sample, layer, h, curr_id, sorted(e.pos for e in entries if not e.is_pad and e is not newest))
                )
                self.kv[layer][h] = [newest]
                result.evictions += 1

    def kept(self):
        return [
            [sorted(e.pos for e in self.kv[layer][h] if not e.is_pad) for h in range(self.n_kv)]
            for layer in range(self.n_layers)
        ]


@dataclass(frozen=True)
class Policy:
    """The oracle's own reading of a method (independent of ``batchmax_tp.core.method``)."""

    blocks: bool  # Algorithm 1: prefill min(s, kv_max) then blocks of p; evict p pairs before a step when full
    keeps_newest: bool  # Algorithm 3: keep only the newest pair after the prompt and whenever the cache is full
    bounded: bool  # the cache holds fewer than kv_max pairs before every decode step
    compresses: bool = False  # SnapKV: one block, then kv_max entries kept; decoding evicts p when full (as "bm")


POLICIES = {
    "bm": Policy(blocks=True, keeps_newest=False, bounded=True),
    "ed": Policy(blocks=False, keeps_newest=True, bounded=True),
    "fkv": Policy(blocks=False, keeps_newest=False, bounded=False),
    "snap": Policy(blocks=False, keeps_newest=False, bounded=True, compresses=True),
}


@torch.no_grad()
def reference_generate(
    model,
    input_ids,
    attention_mask,
    method_name,
    kv_max=None,
    p=None,
    max_new_tokens=1,
    rule="paper",
    rule_params=None,
    force_tokens=None,
    groups=None,
    snap=None,
    layer_kv_max=None,
):
    """Greedy generation with the paper's cache policy (or one of the rules above, BM only), naively.

    ``groups`` (BM): the KV heads that share one budget (the rule's ``share``), e.g. ``[[0, 1]]``: the group holds
    ``len(group) * kv_max`` entries, any of its heads may hold them, and each eviction removes ``len(group) * p``
    of them, the lowest ``(priority, position, head)`` over the group (each entry ranked within its own head);
    default every head alone (the paper).

    ``snap`` (method "snap"): ``{"window": w, "kernel": k}``.

    ``layer_kv_max`` (BM): each layer's own budget per head (``kv_max`` is then not read).

    ``force_tokens`` ``[B, >= max_new_tokens - 1]``: teacher forcing -- decode step t feeds ``force_tokens[:, t-1]``
    instead of the previous argmax (``tokens`` still records the argmaxes).

    Returns a :class:`RefResult`, which also unpacks as ``(logits_per_step, kept, tokens)``:
    ``logits_per_step`` a list of float32 ``[B, V]`` (one per generated token), ``kept[layer][sample][kv_head]``
    the sorted real positions kept at the end, ``tokens`` ``[B, max_new_tokens]``.
    """
    if method_name not in POLICIES:
        raise ValueError(f"unknown method {method_name!r}")
    policy = POLICIES[method_name]
    if policy.blocks or policy.compresses:
        assert p is not None and p >= 1 and kv_max is not None and kv_max > p
    assert (snap is not None) == policy.compresses and (not snap or set(snap) == {"window", "kernel"})
    need = {
        "paper": set(),
        "pooled": {"kernel", "pool"},
        "sinks": {"sinks", "recent"},
        "probe": {"window", "every", "weight"},
        "snapkv": {"window", "every", "weight", "kernel", "pool"},
        "question": {"window", "every", "kernel", "pool", "sinks", "recent"},
    }
    rule_params = dict(rule_params or {})
    optional = {"decode", "recall"} if rule == "question" else set()
    assert rule in need and need[rule] <= set(rule_params) <= need[rule] | optional, (rule, rule_params)
    every = rule_params.get("every", 1)
    assert rule == "paper" or policy.blocks  # rules are BM's
    window = rule_params.get("window", 0)
    if policy.keeps_newest:
        assert kv_max is not None and kv_max >= 2
    assert max_new_tokens >= 1
    input_ids = input_ids.cpu()
    attention_mask = attention_mask.cpu()
    bsz, s = input_ids.shape
    n_layers = model.config.num_hidden_layers
    budgets = list(layer_kv_max) if layer_kv_max is not None else [kv_max] * n_layers
    assert len(budgets) == n_layers and (layer_kv_max is None or policy.blocks)
    first = min(budgets) if policy.blocks else None  # the first block fits every layer

    def full(incoming):  # the layers whose entries and ``incoming`` new ones exceed their own budget
        return [i for i in range(n_layers) if st.size([i]) + incoming > budgets[i]]

    result = RefResult(logits=[], kept=[], tokens=torch.zeros(bsz, max_new_tokens, dtype=torch.long))
    per_sample_logits, per_sample_history = [], []
    for j in range(bsz):
        mask = attention_mask[j].tolist()
        npad = mask.index(1)
        assert all(m == 0 for m in mask[:npad]) and all(m == 1 for m in mask[npad:]), "left padding expected"
        ids = input_ids[j].tolist()
        st = _SampleState(model, npad, groups)
        by_window = rule == "question" and rule_params.get("recall") == "window"
        if by_window:
            st.window_q, st.window_keep = [[] for _ in range(n_layers)], window
        logits = []

        def block(t0, t1):
            index = 0 if t0 == 0 else 1 + (t0 - min(s, first)) // p  # Algorithm 1's block number
            probed = window and t1 < s and index % every == 0
            probe = range(max(t1, s - window), s) if probed else ()
            return st.process([(pos, ids[pos]) for pos in range(t0, t1)], [(pos, ids[pos]) for pos in probe])

        # ---------------- prefill
        if policy.blocks:
            t1 = min(s, first)
            last = block(0, t1)
            while t1 < s:
                t0, t1 = t1, min(s, t1 + p)
                layers = full(t1 - t0)
                if layers:
                    st.evict_bm(
                        p, t0 - 1, result, j, rule=rule, params=rule_params, prefill=True, layers=layers, last=t1 == s
                    )
                last = block(t0, t1)
            if by_window:
                st.choose_by_window(window, rule_params, s - 1, result)
        elif policy.compresses:
            last = st.process([(pos, ids[pos]) for pos in range(s)], window=snap["window"])
            st.snap(kv_max, snap["window"], snap["kernel"])
        else:
            last = block(0, s)
        assert last is not None  # the last prompt token is always real
        logits.append(last)
        history = [st.kept()]
        tok = int(torch.argmax(last))
        gen = [tok]
        # ---------------- decoding
        for t in range(1, max_new_tokens):
            pos = s + t - 1
            if policy.blocks and (layers := full(1)):
                st.evict_bm(p, curr_id=pos - 1, result=result, sample=j, rule=rule, params=rule_params, layers=layers)
            if policy.compresses and st.size() == kv_max:
                st.evict_bm(p, curr_id=pos - 1, result=result, sample=j, rule=rule, params=rule_params)
            if policy.keeps_newest and (t == 1 or st.size() == kv_max):
                # Algorithm 3 removes all but the most recent pair right after the prompt and after a step
                # that fills the cache; doing it just before the next step is the same computation.
                st.keep_newest(result, j, curr_id=pos - 1)
            assert not policy.bounded or all(st.size([i]) < b for i, b in enumerate(budgets))
            fed = tok if force_tokens is None else int(force_tokens[j, t - 1])
            out = st.process([(pos, fed)])
            logits.append(out)
            history.append(st.kept())
            tok = int(torch.argmax(out))
            gen.append(tok)
        result.tokens[j] = torch.tensor(gen)
        per_sample_logits.append(logits)
        per_sample_history.append(history)
    result.logits = [torch.stack([per_sample_logits[j][t] for j in range(bsz)]) for t in range(max_new_tokens)]
    n_kv = model.config.num_key_value_heads
    result.kept_history = [
        [[per_sample_history[j][t][layer] for j in range(bsz)] for layer in range(n_layers)]
        for t in range(max_new_tokens)
    ]
    result.kept = result.kept_history[-1]
    result.kept_after_prefill = result.kept_history[0]
    assert all(len(result.kept[0][j]) == n_kv for j in range(bsz))
    return result


def hf_position_ids(attention_mask):
    """Position ids HF ``generate`` uses for a left-padded batch: cumsum(mask)-1, pads clamped to 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 0)


def rule_string(rule: str, params: dict) -> str:
    """A rule as the engine takes it: ``NAME`` or ``NAME:key=value,...``."""
    return rule if not params else rule + ":" + ",".join(f"{k}={v}" for k, v in params.items())
