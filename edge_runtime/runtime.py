"""The device runtime: the device's model opened once (edge_runtime.engine), a cloud connection opened when a
protocol needs one, and what outlives a request — the device monitor and the connection's link estimates — handed to
each request's session."""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple, Union

from edge_runtime.auto import AUTO_TOKEN, AutoController, auto_eligible, auto_max_draft
from edge_runtime.auto_estimates import AutoEstimates, Shape, sampling_kind
from edge_runtime.auto_record import RecordFile, pair_key
from edge_runtime.client import CloudClient, CloudUnavailable, expect, reconnect_delays
from edge_runtime.config import EdgeConfig, UncertaintyConfig
from edge_runtime.drafter import Drafter
from edge_runtime.engine import open_engine
from edge_runtime.monitor import DeviceMonitor
from edge_runtime.protocols import new_session
from edge_runtime.request import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE, GenerationRequest
from edge_runtime.sessions.auto import AutoSession, observed_round
from edge_runtime.sessions.base import GenerationResult
from edge_runtime.sessions.split import LinkState
from edge_runtime.split_drafter import SplitDrafter
from hat_split import protocols
from hat_split.math.chunking import ema
from hat_split.math.sampling import SamplingParams
from hat_split.math.skip_budget import SkipPolicy
from hat_split.models.chat import encode
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.edge")
REQUEST_MODE_AGE_S = 1.0  # a request starts with the board's power mode read at most this long ago (rounds: 5 s)
SOFTWARE = "hatspec-edge/0.1"


class EdgeRuntime:
    """Context manager owning the device's model (edge_runtime.engine) and, lazily, the cloud client."""

    def __init__(self, config: EdgeConfig, loaded=None):
        """loaded: a torch model already in memory for the torch engine (edge_runtime.engine.open_engine)."""
        self.config = config
        self.client: Optional[CloudClient] = None
        self._session_ids = itertools.count(1)
        self._reached = False  # the cloud answered this runtime once: later failures to connect are transient
        self.monitor = DeviceMonitor(config.device_profile)  # HAT §3.2: profile, power mode, γ for the cloud
        self.link_state: Optional[LinkState] = None  # the split protocols' estimates of this connection
        self.auto_estimates = AutoEstimates()  # auto's measurements, kept across requests (auto_estimates) ...
        self.auto_pair = ""  # ... of this pair of models (auto_record.pair_key; "": none yet)
        self.auto_record = RecordFile(config.auto_record, SOFTWARE) if config.auto_record else None
        self._census_draws = random.Random()  # auto's census requests (EdgeConfig.auto_census), whatever their prompt
        self.split_rates: Dict[str, float] = {}  # private auto requests: decode tokens/s per split protocol
        # uhlm / cuhlm: the skip rule's line and recent uncertainties, kept across requests per protocol and settings
        self.skip_policies: Dict[Tuple[str, UncertaintyConfig], SkipPolicy] = {}
        self.engine = open_engine(config, loaded)

    def __enter__(self) -> "EdgeRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    def connect(self) -> P.Welcome:
        if self.client is not None and not self.client.is_open:
            # closed under the runtime: a session's reconnect failed while it resumed (an answer that `degrade`
            # finished alone ends that way); the next request or report connects afresh
            self.client = None
        if self.client is None:
            link = self.config.link
            e = self.engine
            hello = P.Hello(link.device_id, e.model_name, e.vocab_size, e.fingerprint, SOFTWARE)
            link.security.check("device")
            client = CloudClient(link, hello)
            client.connect()
            self.client = client
            self.link_state = None  # estimates belong to one connection: a new one measures afresh
            self._reached = True
        return self.client.welcome

    def _connect_for_request(self) -> None:
        """Connect before a request. Under link_policy wait or degrade, a cloud that has served this runtime before
        and is unreachable now (a dropped link, a restarting cloud) is retried with backoff for reconnect_timeout_s,
        as a drop mid-answer would be. A cloud never reached (a wrong address) and a refusal (CloudError) fail at
        once with their message."""
        link = self.config.link
        if not self._reached:
            self.connect()
            return
        deadline = time.monotonic() + link.reconnect_timeout_s
        for delay in reconnect_delays(link.backoff_s):
            try:
                self.connect()
                return
            except CloudUnavailable as exc:
                self.close()
                if link.link_policy == "fail" or time.monotonic() + delay > deadline:
                    raise CloudUnavailable(f"{exc} (retried for {link.reconnect_timeout_s:.0f} s)") from None
                log.info("cloud unreachable before a request (%s): retrying in %.1f s", exc, delay)
                time.sleep(delay)

    def encode_prompt(self, prompt: str, chat: bool = False) -> List[int]:
        return encode(self.engine.tokenizer, prompt, chat)

    def run(self, request: GenerationRequest) -> GenerationResult:
        """One request (edge_runtime.request), whole: its prompt encoded (text in the chat template with `chat`),
        the cloud connected when its protocol needs one, its session run. The request's on_text gets the text as it
        is accepted, on_tokens each commit's tokens (and their logprobs when asked) before that; should_stop is asked
        after every commit and ends the request with the reason it returns (a stop sequence, a client gone).
        Protocol auto: `_run_auto`."""
        request = request.seeded()
        prompt = request.prompt
        ids = self.encode_prompt(prompt, request.chat) if isinstance(prompt, str) else list(prompt)
        if request.protocol == protocols.AUTO:
            return self._run_auto(replace(request, prompt=tuple(ids), chat=False), ids)
        record = protocols.get(request.protocol)
        if record.needs_cloud:
            self._connect_for_request()
            self.monitor.refresh_mode(REQUEST_MODE_AGE_S)
        split = record.family == "split"
        if split:
            drafter = self._split_drafter(record.round == "hat", request.sampling, request.seed)
            if self.link_state is None:
                self.link_state = LinkState.configured(self.config.split.up_bps, self.config.split.down_bps)
        else:
            drafter = Drafter(self.engine.token_lm(self.config), request.sampling, self.config.dist_dtype)
        skips = None
        if record.round in ("uhlm", "cuhlm"):
            key = (record.round, self.config.uncertainty)
            skips = self.skip_policies.get(key) or self.skip_policies.setdefault(key, key[1].skip_policy())
        session = new_session(self.config, request, drafter, self.client, self.engine.eos_ids, next(self._session_ids),
                              monitor=self.monitor, link_state=self.link_state if split else None, skip_policy=skips)
        teaching = request.protocol in AUTO_TOKEN
        if teaching:  # what sd (chains and trees) and llm requests measure teaches protocol auto
            self._auto_pair(self.client.welcome)
            session.round_fn = _teaching(session.round_fn, request.protocol, self.auto_estimates)
        try:
            result = session.run(ids, lambda toks: self.engine.tokenizer.decode(toks, skip_special_tokens=True))
        finally:
            if teaching:
                self._auto_save()
        self.monitor.observe(result, self.link_state.draft_s if record.round == "hat" else None)
        return result

    def _auto_pair(self, welcome: P.Welcome) -> None:
        """Auto's estimates for the pair of models of this connection: another pair's are dropped (acceptance is two
        models' agreement); estimates that hold nothing yet start from the record's entry (EdgeConfig.auto_record)."""
        key = pair_key(self.engine.model_name, welcome.model, self.engine.fingerprint, self.config.device_profile)
        if key == self.auto_pair:
            return
        if self.auto_pair:
            log.info("auto: another pair of models (%s): its estimates start afresh", key)
            self.auto_estimates = AutoEstimates()
        self.auto_pair = key
        if self.auto_record is not None:
            self.auto_record.load(key, self.auto_estimates)

    def _auto_save(self) -> None:
        """Auto's estimates into the record, when there is one."""
        if self.auto_record is not None and self.auto_pair:
            self.auto_record.save(self.auto_pair, self.auto_estimates)

    def _run_auto(self, request: GenerationRequest, ids: List[int]) -> GenerationResult:
        """Protocol auto (edge_runtime.auto): a private request runs the split protocol measured fastest so far (each
        tried once first), or slm without split parts; a cloud that cannot be reached, slm; otherwise a token session
        whose rounds the controller picks, degrading to the device alone while the link is down (unless the link
        policy is `fail`). With allow_lossy, slm when it is predicted faster than the best exact protocol."""
        if request.private:
            return self._auto_private(request)
        try:
            self._connect_for_request()
        except CloudUnavailable as exc:
            return self._auto_fixed(request, "slm", f"the cloud unreachable ({exc})")
        self.monitor.refresh_mode(REQUEST_MODE_AGE_S)
        welcome, config = self.client.welcome, self.config
        self._auto_pair(welcome)
        # this prompt's acceptance starts from the recent prompts' that sampled as it does
        kind = sampling_kind(request.sampling)
        self.auto_estimates.begin_request(kind, census=self._census(kind))
        controller = AutoController(self.auto_estimates, auto_eligible(welcome.protocols, request.sampling),
                                    auto_max_draft(welcome.max_draft_len), config.llm_chunk, len(ids),
                                    shares_host=not config.overlaps_prefill, trees=tree_shapes(config, welcome),
                                    eta=config.auto_eta, tree_eta=config.draft_stop_prob,
                                    sla_tps=float(request.sla_tokens_per_s))
        if request.allow_lossy:
            why = controller.local_wins(self.client.base_rtt_s)
            if why:
                return self._auto_fixed(request, "slm", why)
        if config.link.link_policy == "wait":  # auto: the device alone while the cloud is unreachable
            config = replace(config, link=replace(config.link, link_policy="degrade"))
        drafter = Drafter(self.engine.token_lm(config), request.sampling, config.dist_dtype)
        session = AutoSession(config, request.run_by("sd", private=False), drafter,
                              self.client, eos_ids=self.engine.eos_ids, session_id=next(self._session_ids),
                              monitor=self.monitor, controller=controller)
        try:
            result = session.run(ids, lambda toks: self.engine.tokenizer.decode(toks, skip_special_tokens=True))
        finally:
            self._auto_save()
        self.monitor.observe(result)
        return result

    def _auto_private(self, request: GenerationRequest) -> GenerationResult:
        """A private auto request: ushape and hat where this device has split parts (hat with its drafter), each
        tried once, then the one whose requests decoded fastest (a moving average of tokens/s); slm without split
        parts or without the cloud."""
        candidates = []
        for name, hat in (("ushape", False), ("hat", True)):
            try:
                self.engine.split_parts(hat, self.config.split)
                candidates.append(name)
            except (ValueError, OSError) as exc:
                log.debug("auto (private): %s cannot run here: %s", name, exc)
        if not candidates:
            return self._auto_fixed(request, "slm", "private, and this device has no split parts")
        try:
            self._connect_for_request()
        except CloudUnavailable as exc:
            return self._auto_fixed(request, "slm", f"private, the cloud unreachable ({exc})")
        rates = self.split_rates
        unmeasured = [c for c in candidates if c not in rates]
        if unmeasured:
            pick, why = unmeasured[0], f"private: measuring {unmeasured[0]}"
        else:
            pick = max(candidates, key=lambda c: rates[c])
            why = "private: " + ", ".join(f"{c} {rates[c]:.2f} tok/s" for c in candidates) + " (measured)"
        result = self._auto_fixed(request, pick, why)
        rate = result.summary()["decode_tokens_per_s"]
        if rate:
            rates[pick] = ema(rates.get(pick), rate)
        return result

    def _census(self, kind: str) -> bool:
        """Whether the auto request beginning, sampling as `kind`, is a census of the prompts' acceptance: drawn at
        random, whatever its prompt, at EdgeConfig.auto_census's share, more while the census's reads are few
        (AutoEstimates.census_chance)."""
        return self._census_draws.random() < self.auto_estimates.census_chance(kind, self.config.auto_census)

    def _auto_fixed(self, request: GenerationRequest, protocol: str, reason: str) -> GenerationResult:
        """An auto request run whole by one protocol, saying so and why."""
        result = self.run(request.run_by(protocol))
        result.protocol = protocols.AUTO
        result.auto = [{"protocol": protocol, "knob": 0, "tokens": result.n, "rounds": result.rounds,
                        "reason": reason}]
        return result

    def generate(self, prompt: Union[str, Sequence[int]], protocol: str = "sd", params: Optional[SamplingParams] = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **fields) -> GenerationResult:
        """`run` for a request written out: GenerationRequest(prompt, protocol, params, max_new_tokens, **fields)
        (params None: the default sampling, edge_runtime.request)."""
        sampling = SamplingParams(DEFAULT_TEMPERATURE) if params is None else params
        return self.run(GenerationRequest(prompt, protocol, sampling, max_new_tokens, **fields))

    def report(self, stats: Optional[P.DeviceStats] = None) -> P.CloudState:
        """Send the device's current state (power mode read now, γ so far) and, from an agent, what it served lately
        (`stats`) to the cloud; the cloud's state back."""
        self.connect()
        self.monitor.refresh_mode(max_age_s=0.0)
        link = self.link_state
        state = link.device(self.monitor) if link is not None else self.monitor.state()
        return expect(self.client.request(P.Report(state, stats)), P.Reported, P.Report).cloud

    def _split_drafter(self, hat: bool, params: SamplingParams, seed: int) -> SplitDrafter:
        """The device's parts of this runtime's model (and Λ for `hat`), in torch or from the bundle."""
        parts = self.engine.split_parts(hat, self.config.split)
        return SplitDrafter(parts, params, seed, slowdown=self.config.split.slowdown)


def tree_shape(config: EdgeConfig, welcome: P.Welcome) -> Optional[Shape]:
    """The draft tree sd runs on this device (nodes, depth, width) within the cloud's Welcome; None for chains."""
    return _within(welcome, (config.tree_nodes, config.tree_depth, config.tree_width))


def tree_shapes(config: EdgeConfig, welcome: P.Welcome) -> Tuple[Shape, ...]:
    """Every draft tree protocol auto may run sd with (tree_nodes' and auto_trees'), each within the cloud's Welcome
    and once."""
    out: List[Shape] = []
    for shape in config.tree_shapes:
        fitted = _within(welcome, shape)
        if fitted is not None and fitted not in out:
            out.append(fitted)
    return tuple(out)


def _within(welcome: P.Welcome, shape: Shape) -> Optional[Shape]:
    nodes = min(shape[0], welcome.max_tree_nodes)
    if nodes < 1 or welcome.max_tree_depth < 1:
        return None
    return nodes, min(shape[1], welcome.max_tree_depth, nodes), shape[2]


def _teaching(round_fn, protocol: str, estimates: AutoEstimates):
    """`round_fn` of an sd, ksqs or llm request, each round's figures given to protocol auto's estimates (and, before
    its first round, the request's kind of sampling, the cloud's cost report of the session's opening and the board's
    power mode; an sd request's draft tree, if its config drafts one, as that shape's)."""
    opened = [False]

    def run(session) -> None:
        if not opened[0]:
            opened[0] = True
            estimates.begin_request(sampling_kind(session.params))
            estimates.take_report(session.cloud_cost, time.monotonic())
            if session.monitor is not None:
                estimates.take_mode(session.monitor.power_mode)
        tree = tree_shape(session.config, session.client.welcome) if protocol == "sd" else None
        if protocol == "sd" and tree is None:
            tree = eta_chain_of(session.config, session.client.welcome)
        observed_round(session, estimates, protocol, lambda: round_fn(session), tree)
    return run


def eta_chain_of(config: EdgeConfig, welcome: P.Welcome) -> Optional[Shape]:
    """The shape of auto's η-chain (AutoController.eta_chain) when an sd request's chains are it — the longest γ auto
    drafts, ended by auto's η — so that its rounds teach the η-chain's estimates; else None."""
    longest = auto_max_draft(welcome.max_draft_len)
    same = config.auto_eta > 0 and config.draft_stop_prob == config.auto_eta and config.draft_len == longest
    return (longest, longest, 1) if same else None
