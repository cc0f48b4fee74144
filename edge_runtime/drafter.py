"""The device's draft model with its own KV cache, kept in step with the committed sequence.

Drafting feeds whatever committed tokens the cache lacks, then one token per draft step; after the cloud's verdict the
cache is cropped to the accepted prefix (rejected drafts are forgotten, accepted ones are kept and never recomputed).
Each draft token is sampled from the quantized distribution that is sent with it (a wire: float16 values,
hat_split.wire.dist_codec, or a lattice point, hat_split.wire.sqs), so the cloud verifies against exactly the
distribution the device sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from hat_split.wire import dist_codec
from hat_split.models.lm import CausalLM, KVState
from hat_split.math.sampling import SamplingParams, sample, softmax_prob, warp
from hat_split.math.tree import GrownTree, grow_tree
from hat_split.math.verify import acceptance_of_samples


@dataclass
class Drafter:
    lm: CausalLM
    params: SamplingParams
    wire_dtype: str = "float16"
    tokens: List[int] = field(default_factory=list)  # committed sequence (prompt + generated)
    kv: KVState = field(init=False)
    last_logits: np.ndarray = field(init=False, default=None)  # raw logits of the last draft() call
    last_q: List[np.ndarray] = field(init=False, default_factory=list)  # per draft: `# [vocab]` it was sampled from
    local_logits: np.ndarray = field(init=False, default=None)  # raw logits of the last sample_local() call
    can_generate_alone = True  # sessions.base.Session.resume under link_policy "degrade"
    _tree: Tuple[int, int] = field(init=False, default=(0, 0))  # the last draft tree: its start, its cached nodes
    prompt_len: int = field(init=False, default=0)  # tokens of the request's prompt (not compared: someone's text)
    agreed: float = field(init=False, default=0.0)  # of `compared` target tokens read by catch_up(compare=True), the
    compared: int = field(init=False, default=0)  # drafts sd would have had accepted there (an estimate above T = 0)
    marks: List[Tuple[int, bool, float]] = field(init=False, default_factory=list)  # at temperature 0, each target
    # token read by catch_up(compare=True) this request: (its index in `tokens`, whether the draft's argmax named it,
    # that argmax's plain softmax probability: HAT eq. 5's confidence), what an η-ended chain would have done there
    drawn_p: Dict[int, float] = field(init=False, default_factory=dict)  # index in `tokens` → the target's
    # probability of that token as it drew it (protocol llm's replies, when asked: `note_drawn`)

    def __post_init__(self) -> None:
        self.kv = self.lm.new_state()

    @property
    def compute_s(self) -> float:
        """Draft-model time of this request so far (prompt included)."""
        return self.kv.forward_s

    def start(self, prompt: List[int], prefill: bool = True) -> None:
        """New request: forget the old cache and cache the prompt except its last token (prefill=False: later, in
        the first forward that needs the cache)."""
        self.kv = self.lm.new_state()
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.drawn_p = {}
        self.marks = []
        if prefill and len(prompt) > 1:
            self.lm.forward(self.kv, self.tokens[:-1], n_logits=0)

    @property
    def behind(self) -> int:
        """Committed tokens (all but the last, which the next draft feeds) the cache has not read yet."""
        return max(0, len(self.tokens) - 1 - self.kv.length)

    def catch_up(self, max_tokens: int, compare: bool = False) -> int:
        """Read up to max_tokens of what the cache lacks: lets the device use time it would wait anyway (a round in
        which it drafts nothing) so that a later draft starts at once. Returns how many it read. compare: also ask
        the logits of every position read and add, to `agreed` of `compared`, what sd's draft would have had
        accepted at each of the target's tokens (past the prompt): at temperature 0, 1 where the draft's argmax
        named it; above, min(1, q(x) / p(x)) where the cloud said p(x) (`note_drawn`), an unbiased estimate of
        Σ min(p, q) (verify.acceptance_of_samples); at temperature 0 each position's `marks` too. So llm's rounds still
        measure the prompt's acceptance."""
        start = self.kv.length
        feed = self.tokens[start:max(0, len(self.tokens) - 1)][:max(0, max_tokens)]
        # the position after feed[i] holds the committed token start + i + 1; only the target's are compared (the
        # prompt's are someone's text), and only their rows are asked for
        first = min(len(feed), max(0, self.prompt_len - start - 1)) if compare else len(feed)
        if feed:
            logits = self.lm.forward(self.kv, feed, n_logits=len(feed) - first)
            if first < len(feed):
                self._compare(np.asarray(logits), start + first + 1)
        return len(feed)

    def note_drawn(self, probs: List[float]) -> None:
        """The target's probabilities of the next len(probs) tokens to be committed, as it drew them (llm)."""
        at = len(self.tokens)
        self.drawn_p.update((at + i, float(p)) for i, p in enumerate(probs))

    def _compare(self, logits: np.ndarray, at: int) -> None:
        """Row i of logits `# [n, vocab]` is the draft's at the committed token at + i."""
        targets = np.asarray(self.tokens[at:at + logits.shape[0]])
        if self.params.greedy:
            rows, p = np.arange(targets.size), np.ones(targets.size)
            named = np.argmax(logits, axis=-1)
            q = (named == targets).astype(np.float64)
            sure = softmax_prob(logits, named)
            self.marks.extend((at + i, bool(q[i]), float(sure[i])) for i in range(targets.size))
        else:
            rows = np.asarray([i for i in range(targets.size) if at + i in self.drawn_p], dtype=np.int64)
            if not rows.size:
                return
            p = np.asarray([self.drawn_p[at + int(i)] for i in rows])
            q = warp(logits[rows], self.params)[np.arange(rows.size), targets[rows]]
        self.agreed += float(acceptance_of_samples(p, q).sum())
        self.compared += int(rows.size)

    def rollback(self) -> None:
        """Forget cached positions past the committed sequence (drafts of a round that never got its verdict)."""
        keep = max(0, len(self.tokens) - 1)
        if self.kv.length > keep:
            self.lm.crop(self.kv, keep)

    def _next_logits(self, extra: List[int]) -> np.ndarray:
        """Logits `# [1, vocab]` of the position after tokens + extra (feeds what the cache lacks)."""
        feed = (self.tokens + extra)[self.kv.length:]
        return self.lm.forward(self.kv, feed, n_logits=1)

    def draft(self, n: int, rng: np.random.Generator, stop_below: float = 0.0, wire=None,
              budget_bits: int = 0) -> Tuple[List[int], list]:
        """Sample up to n draft tokens; returns them and their wire rows (one per draft, for `wire.pack`).

        wire: how a distribution is quantized, sampled and sent — dist_codec.FloatWire (default, this drafter's
        wire_dtype) or sqs.LatticeWire (qs / ksqs / csqs / sq). The token is drawn from what the row says (except
        for the lossy `sq`), so the cloud verifies against the distribution the device sampled from.
        stop_below = η > 0 ends the draft after the first token whose confidence (plain softmax probability under the
        draft, `softmax_prob`) is below η — HAT eq. 5; that token is still sent.
        budget_bits = B > 0 keeps the longest draft whose rows fit in B bits (SQS §4; at least one draft).
        Both stopping rules read only the device's own distributions, so verification stays exact.
        """
        wire = wire or dist_codec.FloatWire(self.wire_dtype)
        drafts: List[int] = []
        rows, raw, self.last_q = [], [], []
        used_bits = 0
        for _ in range(n):
            logits = self._next_logits(drafts)  # [1, vocab]
            q = warp(logits, self.params)[0]  # [vocab]
            row = wire.quantize(q)
            if budget_bits:
                used_bits += wire.bits(row)
                if drafts and used_bits > budget_bits:
                    break
            token, row, drawn_from = wire.sample(row, q, float(rng.random()))
            raw.append(logits)
            self.last_q.append(drawn_from)
            drafts.append(token)
            rows.append(row)
            if stop_below > 0 and softmax_prob(logits, np.array([token]))[0] < stop_below:
                break
        self.last_logits = np.concatenate(raw, axis=0)  # [len, vocab]: for uncertainty measures (rounds.uhlm)
        return drafts, rows

    def draft_tree(self, budget: int, max_depth: int, width: int, rng: np.random.Generator,
                   stop_below: float = 0.0) -> Tuple[GrownTree, list]:
        """A draft tree (hat_split.math.tree.grow_tree: at most `budget` nodes and `max_depth` levels, `width` new
        nodes per level; top tokens at temperature 0, draws without replacement above; ending after the level whose
        main-line token is below `stop_below`, η) on this drafter's cache, one forward per level; its nodes stay in
        the cache after the committed sequence until `commit_tree`.
        Above temperature 0 every distribution is rounded through the float wire first, so the children are drawn
        from exactly what the cloud decodes; returns the tree (tree.q: those distributions) and the wire rows
        `# [1, vocab]` of the root and of each node (zeros for the last level's, which nothing was drawn from). At
        temperature 0 the shape follows the draft's plain softmax (the top tokens and their path probabilities) and
        no row is returned: greedy verification reads none."""
        if not hasattr(self.lm, "forward_tree"):
            raise ValueError("draft trees need a model that runs them (hat_split.models.tree_lm.TreeLM), not "
                             f"{type(self.lm).__name__}")
        wire = dist_codec.FloatWire(self.wire_dtype)
        rows: list = []

        greedy = self.params.temperature == 0

        def rounded(logits: np.ndarray) -> np.ndarray:  # `# [n, vocab]` raw logits → what the cloud will decode
            if greedy:
                return warp(logits, SamplingParams(1.0))  # the plain softmax
            out = []
            for q in warp(logits, self.params):
                row = wire.quantize(q)
                rows.append(row)
                out.append(dist_codec.dequantize(row)[0])
            return np.stack(out)

        q_root = rounded(self._next_logits([]))[0]
        start = self.kv.length

        def q_after(parents: List[int], tokens: List[int], nodes: List[int]) -> np.ndarray:
            return rounded(self.lm.forward_tree(self.kv, parents, [tokens[n] for n in nodes], start))

        tree = grow_tree(q_root, q_after, budget, max_depth, width, rng.random, greedy, stop_below)
        if not greedy:
            rows.extend(np.zeros_like(rows[0]) for _ in range(len(tree.rows) - len(rows)))
        self._tree = (start, self.kv.length - start)  # where the tree begins, how many of its nodes are cached
        return tree, rows

    def keep_path(self, path: List[int]) -> None:
        """After a tree's verdict, before its tokens are committed: the cache keeps the accepted nodes `path` it
        holds in place and drops every other branch."""
        start, cached = self._tree
        self.lm.keep(self.kv, start, [n for n in path if n < cached])

    def commit_tree(self, tokens: List[int], path: List[int]) -> None:
        """After a tree's verdict: `tokens` committed (the accepted path's tokens, then the cloud's token), `path`
        the accepted nodes."""
        self.keep_path(path)
        self.commit(tokens, len(path))

    def sample_local(self, rng: np.random.Generator) -> int:
        """One token from the draft model alone (protocol `slm`); the caller commits it. Its raw logits stay in
        `local_logits` `# [1, vocab]`."""
        self.local_logits = self._next_logits([])
        return int(sample(warp(self.local_logits, self.params), rng.random(1))[0])

    def commit(self, tokens: List[int], n_accepted_drafts: int = 0) -> None:
        """Append committed tokens, of which the first n_accepted_drafts are this round's accepted drafts.

        Cached positions past the old sequence are valid only for accepted drafts; the rest (rejected drafts) go. A
        cache holding no drafts is not touched: a read of the committed tokens may be in progress on another thread
        (edge_runtime.read_ahead), and it never reads past them.
        """
        if not 0 <= n_accepted_drafts <= len(tokens):
            raise ValueError(f"n_accepted_drafts={n_accepted_drafts} outside 0..{len(tokens)}")
        keep = len(self.tokens) + n_accepted_drafts
        self.tokens.extend(tokens)
        if self.kv.length > keep:
            self.lm.crop(self.kv, keep)
