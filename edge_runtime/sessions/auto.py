"""`--protocol auto` in a token session: one cloud session, and before every round the controller
(edge_runtime.auto) says which exact token protocol runs it (`sd` with its γ or a draft tree, `ksqs` with its γ when
the request samples, or `llm` with its chunk). The cloud's session does not depend on the protocol that opened it (a
Verify and a Generate continue the same sequence), so a switch costs nothing and loses or repeats no token: each
round commits what its protocol's verification or the target's own sampling gives at the committed position, whatever
ran before it. The draft model catches up on the tokens it did not draft when sd or ksqs follows llm
(edge_runtime.drafter feeds what its cache lacks): while the device waits for llm's replies when it has cores of its
own (`overlap_prefill`: on a thread of its own, edge_runtime.read_ahead, so no reply waits for a forward), else in
the first drafting round, a cost the controller weighs before it switches."""
from __future__ import annotations

import time
from typing import Callable, List, Optional

from edge_runtime.auto import AutoController, Choice
from edge_runtime.auto_estimates import GREEDY, AutoEstimates, Shape, sampling_kind
from edge_runtime.read_ahead import ReadAhead
from edge_runtime.rounds.qs import qs_round
from edge_runtime.rounds.token import tree_round, verify_round
from edge_runtime.sessions.base import GenerationResult
from edge_runtime.sessions.token import TokenSession
from hat_split import protocols
from hat_split.math.costmodel import Link

MIN_RATE_FRAME = 4096  # bytes: the cloud's uplink reading of a smaller request is noise (its transfer is within the
# link's jitter and the error of the device's round-trip estimate: a 96-byte Generate read 41 kbit/s of LTE's 5 Mbit/s)
DEGRADED_REASON = "the cloud unreachable: the device alone until it is back (degrade)"


class AutoSession(TokenSession):
    def __init__(self, *args, controller: AutoController, **kwargs):
        """TokenSession's arguments (round_fn is this session's own); controller: this request's choices over the
        runtime's estimates."""
        self.auto = controller
        self._opening = False  # the device waits for SessionOpened
        self._in_flight = 0  # tokens the llm round in flight asks for
        super().__init__(*args, round_fn=lambda s: s.auto_round(), **kwargs)
        # the reads also measure the prompt's acceptance on llm's tokens (AutoEstimates.observe_agreement): above
        # temperature 0 from the probability each was drawn with, which llm's replies then carry
        self.reader = ReadAhead(self.drafter, compare=True)
        self.drawn_probs = sampling_kind(self.params) != GREEDY

    def link(self) -> Link:
        return measured_link(self, self.auto.estimates)

    def _choose(self) -> Choice:
        if self.monitor is not None:  # a power mode that changed (read at most every 5 s) is another board
            self.auto.estimates.take_mode(self.monitor.refresh_mode())
        self._reads()
        # a read in progress counts as not read: the draft model has that much to do still
        choice = self.auto.decide(self.link(), time.monotonic(), self.drafter.behind, self.remaining)
        if choice.protocol != "llm":  # this round drafts: the reader's forward in progress ends first
            self.reader.settle()
            self._reads()
        self.protocol = protocols.get(choice.protocol)  # what this round runs
        self._in_flight = choice.knob if choice.protocol == "llm" else 0
        return choice

    def _reads(self, step: bool = False) -> None:
        """The reader's forwards since the last call, to the cost model (on this thread: it reads them); step: they
        are `_step_probe`'s, a draft step's forward each."""
        for read in self.reader.drain():
            self.auto.estimates.observe_catch_up(read.tokens, read.seconds)
            self.auto.estimates.observe_agreement(read.agreed, read.compared, read.marks)
            if step and read.tokens == 1:
                self.auto.estimates.observe_step_read(read.seconds)

    def _step_probe(self) -> None:
        """Before an llm round, when the draft step in the cloud's state is due (AutoEstimates.step_probe_due) and
        the reader is not reading: one forward of one committed token, timed with the cloud idle between rounds as a
        drafting round's steps are (a read while the cloud computes is not: where the device shares a host with the
        cloud, as here, one-token reads during llm's steps took 0.045-0.048 s against drafting rounds' 0.035-0.038).
        It costs the round one forward, every STEP_PROBE_ROUNDS llm rounds at most; it also reads that token."""
        if self.auto.estimates.step_probe_due():
            self._reads()
            if self.reader.step():
                self._reads(step=True)

    def open(self, prompt: List[int]) -> None:
        """The opening drafts nothing: the first round is chosen once the cloud's SessionOpened, with its cost
        report (a load that began since the last request), is in. The draft model reads the prompt while the device
        waits for it (overlap_prefill) whatever sd's prediction (a load that began since the last request is only
        known from the reply), else in sd's first round, a catch-up the controller prices."""
        self.protocol = protocols.get("llm")
        self._opening = True
        try:
            super().open(prompt)
        finally:
            self._opening = False
        self.auto.estimates.take_report(self.cloud_cost, time.monotonic())

    def while_waiting(self) -> None:
        """On a device with cores of its own (overlap_prefill), at the opening and later while reading is worth it
        (AutoController.worth_reading: sd within reach, or within reach were the prompt easier than believed, or the
        request a census of the prompts' acceptance) and a round may follow the one in flight (a census: in the
        request's last round too, while its read fits in the round, AutoController.census_reads_to_the_end), the
        draft model reads the committed tokens it lacks while the cloud works, on the reader's thread
        (edge_runtime.read_ahead): the reply is taken the moment it comes, whatever forward is in progress. At the
        opening the prompt is read in one forward while sd is within reach (the first round will likely draft and
        wait for all of it), else a few tokens at a time (a load that makes sd the best is only known from the
        reply)."""
        if not self.config.overlaps_prefill:
            return
        if self._opening:
            within = self.auto.sd_within_reach(self.auto.predictions(self.link(), time.monotonic()))
            self.reader.start(whole=within)
            return
        now = time.monotonic()
        if self.remaining <= self._in_flight:  # the round in flight ends the request: nothing drafts after it,
            # only a census reads on, and only while its read fits in the round
            reads = self.auto.census_reads_to_the_end(self.link(), now, self.drafter.behind, self._in_flight)
        else:  # while sd could win, were the prompt easy, or the request is a census
            reads = self.auto.worth_reading(self.link(), now)
        if not reads:
            self.reader.stop()
            return
        self.reader.start()

    def reopen(self, prompt: List[int]) -> None:
        super().reopen(prompt)
        self.auto.estimates.take_report(self.cloud_cost, time.monotonic())

    def auto_round(self) -> None:
        """One round of the protocol the controller picks; its figures go to the estimates."""
        choice = self._choose()
        c = self.config
        if choice.eta:  # auto's η-chain: a chain that η ends, measured as the tree γ × γ × 1 it is
            n = observed_round(self, self.auto.estimates, "sd",
                               lambda: verify_round(self, choice.knob, c.dist_format, choice.eta), tree=choice.tree)
        elif choice.tree is not None:
            nodes, depth, width = choice.tree
            n = observed_round(self, self.auto.estimates, "sd",
                               lambda: tree_round(self, nodes, depth, width, c.dist_format, c.draft_stop_prob),
                               tree=choice.tree)
        elif choice.protocol == "sd":
            n = observed_round(self, self.auto.estimates, "sd",
                               lambda: verify_round(self, choice.knob, self.config.dist_format))
        elif choice.protocol == "ksqs":
            n = observed_round(self, self.auto.estimates, "ksqs", lambda: qs_round(self, "ksqs", choice.knob))
        else:
            self._step_probe()
            n = observed_round(self, self.auto.estimates, "llm", lambda: self.generate(choice.knob))
        self.auto.record(choice, n)

    def resume(self, prompt: List[int], exc: Exception) -> bool:
        self.reader.settle()  # the caches go back to the committed sequence, the device may generate alone
        return super().resume(prompt, exc)

    def run(self, prompt: List[int], decode_text: Callable[[List[int]], str]) -> GenerationResult:
        try:
            result = super().run(prompt, decode_text)
        finally:  # the draft model is the runtime's: no forward of this request outlives it
            self.reader.settle()
            self._reads()
        result.device_compute_s = self.drafter.compute_s  # a read that ended after the close included
        result.protocol = protocols.AUTO
        result.auto = [s.as_dict() for s in self.auto.segments]
        if result.degraded:
            result.auto.append({"protocol": "slm", "knob": 0, "tokens": len(result.degraded), "rounds": 0,
                                "reason": DEGRADED_REASON})
        return result


def observed_round(session: TokenSession, estimates: AutoEstimates, protocol: str, run: Callable[[], None],
                   tree: Optional[Shape] = None) -> int:
    """Run one round of `protocol` ("sd", "ksqs" or "llm": `run` does it; sd with the draft tree `tree` when given) on
    `session` and give its figures to `estimates` (protocol auto's rounds, and the rounds of sd, ksqs and llm
    requests on the same runtime: what a device served teaches auto). Returns the tokens it committed."""
    c, client, d = session.counters, session.client, session.drafter
    n0, drafted0, accepted0, cloud0 = len(session.generated), c.drafted, c.accepted, c.cloud_compute_s
    draft0, up0, down0 = d.compute_s, client.counters.up_bytes, client.counters.down_bytes
    behind = d.behind  # what sd feeds before its first draft; 1 (the last draft of a round wholly accepted) is
    # part of every sd round's first draft step, not a catch-up
    t0 = time.perf_counter()
    run()
    wall, now = time.perf_counter() - t0, time.monotonic()
    up, down = client.counters.up_bytes - up0, client.counters.down_bytes - down0
    if session.uplink_bps > 0 and up >= MIN_RATE_FRAME:
        estimates.take_uplink(session.uplink_bps, client.base_rtt_s)
    link = measured_link(session, estimates)  # with the rate this round's upload was measured at, if it could be
    cloud_s, n = c.cloud_compute_s - cloud0, len(session.generated) - n0
    if tree is not None:
        estimates.observe_tree(tree, n, d.compute_s - draft0, cloud_s, up, down, wall, link, now,
                               caught_up=behind if behind > 1 else 0, sent=c.drafted - drafted0,
                               accepted=c.accepted - accepted0)
    elif protocol in ("sd", "ksqs"):
        estimates.observe_sd(c.drafted - drafted0, c.accepted - accepted0, d.compute_s - draft0, cloud_s, up, down,
                             wall, link, now, caught_up=behind if behind > 1 else 0, protocol=protocol)
    else:
        estimates.observe_llm(n, cloud_s, up, down, wall, link, now)
    return n


def measured_link(session: TokenSession, estimates: AutoEstimates) -> Link:
    """The link as measured so far: the round trip now (CloudClient.base_rtt_s) and the uplink rate the cloud last
    saw on a request of at least MIN_RATE_FRAME bytes, while the round trip says it is the same link (0: none yet or
    another link, the uplink taken as free: AutoEstimates.uplink_at)."""
    rtt = session.client.base_rtt_s
    return Link(rtt, estimates.uplink_at(rtt), 0.0)
