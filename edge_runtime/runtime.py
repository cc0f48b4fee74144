"""The device runtime: the draft model loaded once, a cloud connection opened when a protocol needs one, and what
outlives a request — the device monitor and the connection's link estimates — handed to each request's session."""
from __future__ import annotations

import itertools
import logging
import time
from typing import List, Optional, Sequence, Union

from edge_runtime.backends.loader import open_bundle
from edge_runtime.backends.split_parts import TorchSplitParts
from edge_runtime.client import CloudClient, CloudUnavailable, expect, reconnect_delays
from edge_runtime.config import EdgeConfig
from edge_runtime.drafter import Drafter
from edge_runtime.monitor import DeviceMonitor
from edge_runtime.protocols import new_session
from edge_runtime.request import DEFAULT_MAX_NEW_TOKENS, GenerationRequest
from edge_runtime.sessions.base import GenerationResult
from edge_runtime.sessions.split import LinkState
from edge_runtime.split_drafter import SplitDrafter
from hat_split import protocols
from hat_split.extras import need
from hat_split.files.bundle import BundleError
from hat_split.math.sampling import SamplingParams
from hat_split.models.chat import encode
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, model_gguf
from hat_split.models.lm import CausalLM
from hat_split.models.loading import eos_ids, load_model, load_tokenizer, quantize_weights, vocab_fingerprint
from hat_split.models.placement import resolve_device
from hat_split.models.partition import SplitModel, holds_all_layers
from hat_split.models.registry import MODELS, get_model_spec
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.edge")


class EdgeRuntime:
    """Context manager owning the draft model and, lazily, the cloud client."""

    def __init__(self, config: EdgeConfig, loaded=None):
        self.config = config
        self.client: Optional[CloudClient] = None
        self._split = None  # hat_split.models.partition.SplitModel of this runtime's model, built on first use
        self._adapter = None
        self._adapter_lm = None  # hat_split.models.draft_lm.AdapterLM when token_draft is "adapter"
        self._split_parts = {}  # (protocol is hat, draft vocabulary) → backends.split_parts (torch or the
        # bundle's), built once
        self._session_ids = itertools.count(1)
        self._reached = False  # the cloud answered this runtime once: later failures to connect are transient
        self.monitor = DeviceMonitor(config.device_profile)  # HAT §3.2: profile, power mode, γ for the cloud
        self.link_state: Optional[LinkState] = None  # the split protocols' estimates of this connection
        engine = config.engine
        if engine.backend == "llamacpp":  # the model's GGUF file on llama.cpp: no torch model on the device
            if loaded is not None:
                raise ValueError("backend llamacpp runs the model's GGUF file; it takes no pre-loaded torch model")
            self.loaded, self.bundle = None, None
            # sequences: a request's drafter state and the next one's overlap for a moment (a state's id is freed
            # when it is dropped); they share the n_ctx positions
            self.lm = LlamaCppLM(model_gguf(config.model),
                                 LlamaCppSettings(engine.n_ctx, engine.n_batch, engine.threads, n_seq_max=4,
                                                  n_gpu_layers=engine.n_gpu_layers))
            self.tokenizer, self.vocab_size = load_tokenizer(config.model), self.lm.vocab_size
            self.model_name = get_model_spec(config.model).name if config.model in MODELS else str(config.model)
            self.fingerprint = vocab_fingerprint(self.tokenizer)
            self.eos_ids = frozenset(self.lm.eog_ids())
            self.lm.warm_up()
            return
        if engine.backend != "torch":  # exported artifacts: no torch model on the device
            if loaded is not None:
                raise ValueError(f"backend {engine.backend} runs a bundle; it takes no pre-loaded torch model")
            self.loaded, self.bundle = None, open_bundle(config)
            man = self.bundle.manifest
            self.tokenizer, self.vocab_size = self.bundle.tokenizer, man.model["vocab"]
            self.model_name, self.fingerprint = man.model["name"], man.model["vocab_fingerprint"]
            self.eos_ids = frozenset(man.model.get("eos_ids", []))
            self.lm = self._bundle_draft()
            return
        torch = need("torch", "hat-edge --backend torch (a model; a device without torch runs a bundle: --backend "
                              "onnxruntime --bundle DIR)")
        need("transformers", "hat-edge --backend torch")
        if engine.threads:
            torch.set_num_threads(engine.threads)
        if loaded is None:
            loaded = load_model(config.model, dtype=engine.dtype, device=resolve_device(engine.device))
            quantize_weights(loaded.model, engine.weight_quant)
        elif engine.weight_quant != "none":
            raise ValueError("weight_quant applies when the runtime loads the model; quantize a pre-loaded one first")
        self.loaded, self.bundle = loaded, None
        self.tokenizer = self.loaded.tokenizer
        self.lm = CausalLM(self.loaded.model)
        self.vocab_size = self.lm.vocab_size
        if holds_all_layers(self.loaded.model):  # a model holding only its split parts runs no whole pass
            self.lm.warm_up()
        self.model_name = self.loaded.spec.name if self.loaded.spec is not None else str(config.model)
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.eos_ids = frozenset(eos_ids(self.loaded.model, self.tokenizer))

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
            hello = P.Hello(link.device_id, self.model_name, self.vocab_size, self.fingerprint, "hatspec-edge/0.1")
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
        return encode(self.tokenizer, prompt, chat)

    def run(self, request: GenerationRequest) -> GenerationResult:
        """One request (edge_runtime.request), whole: its prompt encoded (text in the chat template with `chat`),
        the cloud connected when its protocol needs one, its session run. The request's on_text gets the text as it
        is accepted, on_tokens each commit's tokens (and their logprobs when asked) before that; should_stop is asked
        after every commit and ends the request with the reason it returns (a stop sequence, a client gone)."""
        record = protocols.get(request.protocol)
        request = request.seeded()
        prompt = request.prompt
        ids = self.encode_prompt(prompt, request.chat) if isinstance(prompt, str) else list(prompt)
        if record.needs_cloud:
            self._connect_for_request()
            self.monitor.refresh_mode()
        split = record.family == "split"
        if split:
            drafter = self._split_drafter(record.round == "hat", request.sampling, request.seed)
            if self.link_state is None:
                self.link_state = LinkState.configured(self.config.split.up_bps, self.config.split.down_bps)
        else:
            drafter = Drafter(self._token_lm(), request.sampling, self.config.dist_dtype)
        session = new_session(self.config, request, drafter, self.client, self.eos_ids, next(self._session_ids),
                              monitor=self.monitor, link_state=self.link_state if split else None)
        result = session.run(ids, lambda toks: self.tokenizer.decode(toks, skip_special_tokens=True))
        self.monitor.observe(result, self.link_state.draft_s if record.round == "hat" else None)
        return result

    def generate(self, prompt: Union[str, Sequence[int]], protocol: str = "sd", params: Optional[SamplingParams] = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, **fields) -> GenerationResult:
        """`run` for a request written out: GenerationRequest(prompt, protocol, params, max_new_tokens, **fields)
        (params None: the default sampling, edge_runtime.request)."""
        sampling = GenerationRequest.__dataclass_fields__["sampling"].default if params is None else params
        return self.run(GenerationRequest(prompt, protocol, sampling, max_new_tokens, **fields))

    def report(self, stats: Optional[P.DeviceStats] = None) -> P.CloudState:
        """Send the device's current state (power mode read now, γ so far) and, from an agent, what it served lately
        (`stats`) to the cloud; the cloud's state back."""
        self.connect()
        self.monitor.refresh_mode(max_age_s=0.0)
        link = self.link_state
        state = link.device(self.monitor) if link is not None else self.monitor.state()
        return expect(self.client.request(P.Report(state, stats)), P.Reported, P.Report).cloud

    def _parts(self, adapter: bool):
        """This runtime's model cut at split.m (and, when asked, its distilled Λ), built once."""
        from hat_split.models.adapter import load_adapter  # torch

        c = self.config.split
        if self.loaded is None:
            raise ValueError(f"the split protocols (ushape, hat) and the adapter's draft run on the torch engine or a "
                             f"hat-export bundle; this device runs {self.config.engine.backend}")
        if self._split is None:
            self._split = SplitModel(self.loaded.model, c.m, c.tail)
        if adapter and self._adapter is None:
            if not c.adapter:
                raise ValueError("protocol hat needs a distilled adapter: pass --adapter DIR "
                                 "(make one with hat-distill)")
            self._adapter = load_adapter(c.adapter, self._split)
        return self._split, self._adapter

    def _bundle_draft(self):
        """A bundle's draft chain for the token protocols, opened and warmed up now if the bundle has it; a bundle of
        split parts only (hat-export --parts hat) opens it on demand,
        so asking a token protocol says what is missing."""
        try:
            lm = self.bundle.draft_lm()
        except BundleError:
            return None
        lm.warm_up()
        return lm

    def _token_lm(self):
        """The token protocols' draft: the whole model, or the split draft output ∘ Λ ∘ input (token_draft)."""
        if self.bundle is not None:  # a bundle's chain is chosen by token_draft at open
            return self.lm if self.lm is not None else self.bundle.draft_lm()  # the latter says what is missing
        if self.config.engine.token_draft == "model":
            return self.lm
        if self._adapter_lm is None:
            from hat_split.models.draft_lm import AdapterLM  # torch

            self._adapter_lm = AdapterLM(*self._parts(adapter=True), slowdown=self.config.split.slowdown)
            self._adapter_lm.warm_up()
        return self._adapter_lm

    def _split_drafter(self, hat: bool, params: SamplingParams, seed: int) -> SplitDrafter:
        """The device's parts of this runtime's model (and Λ for `hat`), in torch or from the bundle."""
        c = self.config.split
        key = (hat, c.draft_vocab if hat else 0)  # the config may change between requests (hat-bench's rows)
        if key not in self._split_parts:
            if self.bundle is not None:
                if hat and c.draft_vocab:
                    raise ValueError("split.draft_vocab needs the torch engine: a bundle's output part is the whole "
                                     "head (drafting over a subset from a bundle is not exported)")
                self._split_parts[key] = self.bundle.split_parts(adapter=hat)
            else:
                from hat_split.models.adapter import load_draft_vocab

                split, adapter = self._parts(adapter=hat)
                ids = load_draft_vocab(c.adapter, c.draft_vocab) if key[1] else None
                self._split_parts[key] = TorchSplitParts(split, adapter if hat else None, ids)
        return SplitDrafter(self._split_parts[key], params, seed, slowdown=self.config.split.slowdown)
