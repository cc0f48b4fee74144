"""One request to the device as one frozen object: `GenerationRequest`, built once by whoever asks (`hat-edge
generate`, the agent's `/generate`, its OpenAI endpoints) and passed whole to the runtime and to the session.

`RequestDefaults` is what a request gets for what it does not name. There is one set of defaults, here: the sampling
temperature is 1.0 (OpenAI's API default, and the model's own distribution: what the exact protocols reproduce),
nucleus and top-k off, 128 new tokens, a fresh random seed, protocol `sd`. `hat-edge generate`'s flags and `hat-edge
serve`'s (the agent's `[request]` table) replace them for that command; a field a request names wins over both.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional, Sequence, Tuple, Union

from hat_split import protocols
from hat_split.files.settings import setting
from hat_split.math.logprobs import MAX_TOP_LOGPROBS, Logprobs
from hat_split.math.sampling import SamplingParams
from hat_split.wire.messages import MAX_PACE

MAX_NEW_TOKENS_LIMIT = 8192  # a request asking for more is refused before anything runs
SEED_LIMIT = 2**63  # seeds name streams in [0, 2**63)

OnText = Callable[[str], None]  # the text accepted so far, as it grows (UTF-8 sequences held back until complete)
OnTokens = Callable[[List[int], Optional[Logprobs]], None]  # each commit's tokens, with their logprobs when asked
ShouldStop = Callable[[], str]  # asked after every commit: a finish reason ("stop", "cancelled") ends the request


@dataclass(frozen=True)
class RequestDefaults:
    """What a request gets for each field it does not name (module docstring): `hat-edge generate`'s flags, or the
    agent's `[request]` table (`hat-edge serve`'s flags)."""

    protocol: str = setting("sd", "a protocol of hat_split.protocols, or auto (the device chooses among the exact "
                            "ones and switches at round boundaries: edge_runtime.auto)",
                            old_keys=("../default_protocol",))
    temperature: float = setting(1.0, "sampling temperature; 0 = greedy (1.0: OpenAI's API default)")
    top_p: float = setting(1.0, "nucleus mass; 1 = off")
    top_k: int = setting(0, "most likely tokens kept; 0 = off")
    max_new_tokens: int = setting(128, "tokens generated at most")
    seed: Optional[int] = setting(None, "None: a fresh random seed per request; a number: every request that names "
                                  "none")
    private: bool = setting(False, "tokens never leave the device: only the split protocols (hidden states cross) and "
                            "slm run; a token protocol is refused")
    allow_lossy: bool = setting(False, "protocol auto may also choose slm (the device alone, not the target's "
                                "distribution) when it is predicted faster")
    sla_tokens_per_s: float = setting(0.0, "protocol auto: the pace (tokens/s after the first) the request must keep; "
                                      "auto then runs, of the protocols predicted to keep it, the one that adds the "
                                      "least cloud compute per token (the fleet's figure), the fastest when none does; "
                                      "0 = as fast as it can", flag="--sla-tokens-per-s")

    def __post_init__(self) -> None:
        self.request("x")  # the same checks a request gets, with the field's name in each message
        self.request("x", protocol=protocols.AUTO)  # ... and an auto request (its fields, `request`)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)

    def request(self, prompt: Union[str, Sequence[int]], *, protocol: Optional[str] = None,
                temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
                max_new_tokens: Optional[int] = None, seed: Optional[int] = None, private: Optional[bool] = None,
                allow_lossy: Optional[bool] = None, sla_tokens_per_s: Optional[float] = None,
                **rest) -> GenerationRequest:
        """A request for `prompt`: what is given (not None) wins, the rest comes from these defaults. `rest`: the
        request's other fields (chat, logprobs, the callbacks). allow_lossy and sla_tokens_per_s are auto's: their
        defaults go to auto's requests only (`hat-edge generate --protocol llm,sd,auto` with an SLA, an agent whose
        default protocol is sd), named for another protocol they are refused."""
        pick = lambda given, default: default if given is None else given  # noqa: E731
        sampling = SamplingParams(pick(temperature, self.temperature), pick(top_k, self.top_k),
                                  pick(top_p, self.top_p))
        name = pick(protocol, self.protocol)
        auto = name == protocols.AUTO
        return GenerationRequest(prompt, name, sampling, pick(max_new_tokens, self.max_new_tokens),
                                 pick(seed, self.seed), private=pick(private, self.private),
                                 allow_lossy=pick(allow_lossy, self.allow_lossy and auto),
                                 sla_tokens_per_s=pick(sla_tokens_per_s, self.sla_tokens_per_s if auto else 0.0),
                                 **rest)


DEFAULT_TEMPERATURE = RequestDefaults.temperature
DEFAULT_MAX_NEW_TOKENS = RequestDefaults.max_new_tokens


@dataclass(frozen=True)
class GenerationRequest:
    """One generation. `prompt`: text (a user turn in the model's chat template with `chat`) or token ids."""

    prompt: Union[str, Tuple[int, ...]]
    protocol: str = "sd"  # hat_split.protocols
    sampling: SamplingParams = SamplingParams(DEFAULT_TEMPERATURE)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    seed: Optional[int] = None  # None: a fresh random one (the session draws it)
    chat: bool = False
    logprobs: Optional[int] = None  # k: each token's log-probability and its k most likely alternatives
    private: bool = False  # only the split protocols and slm (token ids never leave the device)
    allow_lossy: bool = False  # auto may choose slm
    sla_tokens_per_s: float = 0.0  # auto: the pace to keep at the least cloud compute per token (0: the fastest)
    on_text: Optional[OnText] = field(default=None, compare=False)
    on_tokens: Optional[OnTokens] = field(default=None, compare=False)  # called before on_text gets the text
    should_stop: Optional[ShouldStop] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        if not self.prompt:
            raise ValueError("the prompt is empty")
        protocols.check_requestable(self.protocol)  # a ValueError naming the known ones
        for name in ("private", "allow_lossy"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.private and self.protocol != protocols.AUTO and protocols.get(self.protocol).family == "token":
            raise ValueError(f"protocol {self.protocol} sends token ids to the cloud; a private request runs "
                             f"{', '.join(protocols.of_family('split') + protocols.of_family('local'))} or auto")
        if self.allow_lossy and self.protocol != protocols.AUTO:
            raise ValueError(f"allow_lossy lets protocol auto choose a lossy protocol; this request names "
                             f"{self.protocol}")
        sla = self.sla_tokens_per_s
        if isinstance(sla, bool) or not isinstance(sla, (int, float)) or not 0 <= sla <= MAX_PACE:
            raise ValueError(f"sla_tokens_per_s must be a number of tokens/s in [0, {MAX_PACE:g}] "
                             f"(0: none), got {sla!r}")  # NaN and infinities too
        if sla and self.protocol != protocols.AUTO:
            raise ValueError(f"sla_tokens_per_s asks protocol auto to keep a pace at the least cloud compute; this "
                             f"request names {self.protocol}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, "
                             f"got {self.max_new_tokens!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")

    def run_by(self, protocol: str, **fields) -> "GenerationRequest":
        """This request as protocol auto runs it with `protocol`: auto's own fields (allow_lossy, sla_tokens_per_s)
        spent, `fields` replaced too."""
        return replace(self, protocol=protocol, allow_lossy=False, sla_tokens_per_s=0.0, **fields)

    def seeded(self) -> "GenerationRequest":
        """This request with its seed drawn now when it named none (one seed per request: the device and the cloud
        derive independent streams from it)."""
        if self.seed is not None:
            return self
        return replace(self, seed=random.SystemRandom().randrange(2**62))
