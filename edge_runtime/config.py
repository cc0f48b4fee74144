"""The device's one typed configuration, passed whole: `EdgeConfig`, with its link (`LinkConfig`: how to reach the
cloud and what to do when the link drops), its engine (`EngineConfig`: what runs the draft) and each protocol
family's settings (`UncertaintyConfig`, `QSConfig`, `SplitConfig`) as nested tables. `hat-edge --config FILE` reads it
from TOML (hat_split.files.config_file)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Tuple

import numpy as np

from edge_runtime.policy.policies import POLICIES
from hat_split.files.bundle import PRECISIONS
from hat_split.files.settings import setting
from hat_split.math.calibration import Calibration
from hat_split.math.skip_budget import SkipPolicy
from hat_split.math.tree import parse_shapes
from hat_split.math.uncertainty import PerturbationConfig
from hat_split.models.placement import check_device
from hat_split.models.registry import MODEL_DTYPES, WEIGHT_QUANTS
from hat_split.net.security import LinkSecurity
from hat_split.wire.dist_codec import MAX_ELL, MAX_SPARSE_K, WIRE_DTYPES
from hat_split.wire.hidden_codec import HIDDEN_FORMATS
from hardware.device_profiles import ProfileError, get_profile

OVERLAP_MODES = ("auto", "on", "off")
LINK_POLICIES = ("wait", "degrade", "fail")  # when the link drops mid-answer (sessions.base.Session.resume)
CHUNKING_MODES = ("auto", "off")
DRAFT_STOPS = ("eta", "cost")  # how hat's chain draft ends (SplitConfig.draft_stop)
TOKEN_DRAFTS = ("model", "adapter")
BACKENDS = ("torch", "onnxruntime", "tensorrt", "llamacpp")
BUNDLE_BACKENDS = ("onnxruntime", "tensorrt")  # run a hat-export bundle's graphs
K_MODES = ("online", "offline")
SKIP_RULES = ("threshold", "answer")
DIST_FORMATS = ("dense", "sparse", "auto")


@dataclass(frozen=True)
class UncertaintyConfig:
    """U-HLM / CU-HLM settings (papers 001 and 000); defaults are the papers' unless calibrated."""

    u_threshold: float = setting(0.5, "skip the upload when u <= this (U-HLM eq. 8); < 0 never skips")
    samples: int = setting(20, "M perturbed temperatures", flag="--perturb-samples")
    theta_max: float = setting(2.0, "temperatures ~ U[0, θmax]")
    random_skip_prob: float = setting(0.5, "randhlm: skip with this probability", flag="--skip-prob")
    beta_a: float = setting(0.82, "rejection model β = a·u + b (U-HLM eq. 5; the paper's fit until hat-calibrate "
                            "runs)")
    beta_b: float = setting(-0.06, "rejection model's intercept b (beta_a's line)")
    k_mode: str = setting("online", "cuhlm: \"online\" (eq. 24, per token) or \"offline\" (fixed k, eq. 21)",
                          choices=K_MODES)
    k_offline: int = setting(30, "cuhlm offline k* (paper: 30 for θ = 0.1)")
    k_theta: float = setting(0.1, "tolerance θ on the resampling distortion")
    k_max: int = setting(8192, "cap on online k")
    softplus_eta: float = setting(10.0, "η of the softplus in eq. 22-23")
    prob_bits: int = setting(8, "b_prob: bits per uploaded probability")
    exact: bool = setting(False, "cuhlm: sample the draft from the reconstruction it sends, so verification is "
                          "unbiased")
    skip_rule: str = setting("threshold", "uhlm / cuhlm: \"threshold\" (skip when u <= u_threshold, U-HLM eq. 8) or "
                             "\"answer\" (at most answer_risk expected would-be-rejected skips per answer; "
                             "hat_split.math.skip_budget)", choices=SKIP_RULES)
    answer_risk: float = setting(0.5, "skip_rule answer: ε, the expected would-be-rejected skips one answer may carry")
    refit: bool = setting(False, "refit the rejection line online from the uploads' verdicts (this and recent "
                          "requests); skip_rule threshold then skips at token_risk on the refitted line")
    token_risk: float = setting(0.02, "skip_rule threshold with refit: the predicted rejection risk per token")
    explore: float = setting(0.05, "with refit: the share of would-be skips uploaded anyway (the line's low end)")
    refit_memory: int = setting(2000, "with refit: the tokens the line and the threshold remember")

    def __post_init__(self) -> None:
        if not -1.0 <= self.u_threshold <= 1.0:
            raise ValueError(f"u_threshold must be in [-1, 1], got {self.u_threshold}")
        self.perturbation  # validates samples and theta_max
        if not 0.0 <= self.random_skip_prob <= 1.0:
            raise ValueError(f"random_skip_prob must be in [0, 1], got {self.random_skip_prob}")
        if self.k_mode not in K_MODES:
            raise ValueError(f"k_mode must be online or offline, got {self.k_mode!r}")
        if self.k_offline < 1 or self.k_max < 1 or not self.k_theta > 0 or not self.softplus_eta > 0:
            raise ValueError("k_offline and k_max must be >= 1, k_theta and softplus_eta > 0")
        if not 1 <= self.prob_bits <= 24:
            raise ValueError(f"prob_bits must be in 1..24, got {self.prob_bits}")
        if self.skip_rule not in SKIP_RULES:
            raise ValueError(f"skip_rule must be threshold or answer, got {self.skip_rule!r}")
        if not (0.0 <= self.answer_risk < float("inf")) or not 0.0 <= self.token_risk <= 1.0:
            raise ValueError(f"answer_risk must be a finite number >= 0 and token_risk in [0, 1], got "
                             f"{self.answer_risk}, {self.token_risk}")
        if not 0.0 <= self.explore < 1.0 or self.refit_memory < 1:
            raise ValueError(f"explore must be in [0, 1) and refit_memory >= 1, got {self.explore}, "
                             f"{self.refit_memory}")

    @property
    def perturbation(self) -> PerturbationConfig:
        return PerturbationConfig(self.samples, self.theta_max)

    def calibrated(self, cal: Calibration, rule: str = "risk-prone") -> "UncertaintyConfig":
        """These settings with a hat-calibrate result: its line, threshold, k*, θ and the M, θmax it measured u with."""
        return replace(self, u_threshold=float(np.clip(cal.threshold(rule), -1.0, 1.0)), beta_a=cal.fit.a,
                       beta_b=cal.fit.b, k_offline=cal.k_star, k_theta=cal.k_theta, samples=cal.perturb_samples,
                       theta_max=cal.theta_max,
                       token_risk=cal.risk_budget if rule == "risk-budget" and cal.risk_budget > 0 else self.token_risk)

    def skip_policy(self) -> SkipPolicy:
        """The skip decision these settings describe (a new one: the runtime keeps one across requests)."""
        return SkipPolicy(self.skip_rule, self.u_threshold, (self.beta_a, self.beta_b), epsilon=self.answer_risk,
                          token_risk=self.token_risk, refit=self.refit, explore=self.explore,
                          memory=self.refit_memory)


@dataclass(frozen=True)
class QSConfig:
    """QS-SD / SQS-SD settings (papers 003 and 002); defaults are the papers' where they give one."""

    ell: int = setting(100, "lattice resolution ℓ (SQS §4: 100); the dqn policy picks its own")
    k: int = setting(16, "ksqs: top-K support size")
    alpha: float = setting(0.0005, "csqs: target dropped mass α (SQS §4)", flag="--csqs-alpha", aliases=("--alpha",))
    eta: float = setting(0.001, "csqs: learning rate η of the threshold (SQS §4)",
                         flag="--csqs-eta", aliases=("--eta",))
    beta: float = setting(0.01, "csqs: initial threshold β_1", flag="--csqs-beta", aliases=("--beta",))
    budget_bits: int = setting(0, "B > 0: each round drafts the longest L whose rows fit in B bits (SQS §4: 5000)")
    policy: str = setting("static", "\"static\" (draft_len, ell) | \"heuristic\" (QS-SD §V) | \"dqn\" "
                          "(hat-train-policy)", choices=POLICIES)
    policy_file: str = setting("", "dqn: the trained network", metavar="PATH")

    def __post_init__(self) -> None:
        if not 1 <= self.ell <= MAX_ELL:
            raise ValueError(f"ell must be in 1..{MAX_ELL}, got {self.ell}")
        if not 1 <= self.k <= MAX_SPARSE_K:
            raise ValueError(f"k must be in 1..{MAX_SPARSE_K}, got {self.k}")
        if not 0 < self.alpha < 1 or not self.eta > 0 or not 0 <= self.beta <= 1:
            raise ValueError("csqs needs 0 < alpha < 1, eta > 0 and 0 <= beta <= 1")
        if self.budget_bits < 0:
            raise ValueError("budget_bits must be >= 0 (0: fixed draft length)")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.policy == "dqn" and not self.policy_file:
            raise ValueError("the dqn policy needs policy_file (a hat-train-policy output)")


@dataclass(frozen=True)
class SplitConfig:
    """HAT / U-shape settings (paper 004); defaults are the paper's where it gives one."""

    m: int = setting(2, "layers of the device's input part (HAT: 2 of 32); the model is the runtime's `model`")
    tail: int = setting(0, "last layers kept on the device with the head")
    adapter: str = setting("", "hat-distill artifact directory: Λ, or a feature drafter (protocol hat needs one)",
                           metavar="DIR")
    hidden_format: str = setting("float16", "hidden states on the wire: float16 | float32 | int8 "
                                 "(hat_split.wire.hidden_codec)", choices=HIDDEN_FORMATS)
    draft_stop_prob: float = setting(0.6, "HAT's η (eq. 5): end a draft after a token whose draft probability is "
                                     "below it",
                         flag="--hat-draft-stop-prob", aliases=("--hat-eta",), old_keys=("eta",))
    draft_stop: str = setting("eta", "how hat's chain draft ends: \"eta\" (eq. 5, draft_stop_prob) | \"cost\" "
                              "(before a draft whose expected tokens do not repay its measured cost: acceptance per "
                              "confidence and round seconds measured on this connection; hat_split.math.draft_stop)",
                              choices=DRAFT_STOPS, flag="--hat-draft-stop")
    draft_len: int = setting(8, "tokens drafted per round at most (HAT's draft length)",
                             flag="--hat-draft-len", aliases=("--max-draft",), old_keys=("max_draft",))
    chunking: str = setting("auto", "prompt chunking: \"auto\" (the cloud's eq. 3 answer) | \"off\" (one chunk)",
                            choices=CHUNKING_MODES)
    chunk_tokens: int = setting(0, "> 0: a fixed chunk size instead")
    parallel_draft: bool = setting(True, "§3.5: draft continuations of the top-k alternatives while the cloud "
                                   "verifies")
    pd_topk: int = setting(3, "k of parallel drafting")
    up_bps: float = setting(0.0, "initial β_up guess (a link profile's), bit/s; replaced by the cloud's "
                            "measurements")
    down_bps: float = setting(0.0, "initial β_down guess, bit/s; replaced by the device's own measurements")
    slowdown: float = setting(1.0, "> 1 emulates a slower board: device compute is stretched to this many times "
                              "its time")
    draft_vocab: int = setting(0, "> 0: hat's drafts (Λ or the feature drafter) over the N most frequent tokens of "
                               "its training data (a head N rows tall; a bundle's is fixed at export); 0: all",
                               metavar="N")
    tree_nodes: int = setting(0, "> 0: hat's Λ drafts a tree of at most this many nodes a round (hat_split.math.tree; "
                              "the middle layers verify it in one forward; η ends it after the level whose main-line "
                              "token is below it; parallel drafting does not apply); 0: chains",
                              flag="--hat-tree-nodes")
    tree_depth: int = setting(6, "levels of hat's draft tree at most", flag="--hat-tree-depth")
    tree_width: int = setting(2, "new nodes per level of hat's draft tree", flag="--hat-tree-width")

    def __post_init__(self) -> None:
        if not 0 <= self.tree_nodes <= 1024 or not 1 <= self.tree_depth <= 64 or not 1 <= self.tree_width <= 64:
            raise ValueError(f"tree_nodes must be in 0..1024, tree_depth and tree_width in 1..64; got "
                             f"{self.tree_nodes}, {self.tree_depth}, {self.tree_width}")
        if self.m < 1 or self.tail < 0:
            raise ValueError("m must be >= 1 (embeddings alone reveal the tokens) and tail >= 0")
        if self.hidden_format not in HIDDEN_FORMATS:
            raise ValueError(f"hidden_format must be one of {', '.join(HIDDEN_FORMATS)}, got {self.hidden_format!r}")
        if not 0.0 <= self.draft_stop_prob < 1.0:
            raise ValueError(f"draft_stop_prob must be in [0, 1), got {self.draft_stop_prob}")
        if not 1 <= self.draft_len <= 64:
            raise ValueError(f"draft_len must be in 1..64, got {self.draft_len}")
        if self.draft_stop not in DRAFT_STOPS:
            raise ValueError(f"draft_stop must be one of {', '.join(DRAFT_STOPS)}, got {self.draft_stop!r}")
        if self.draft_stop == "cost" and self.tree_nodes:
            raise ValueError("draft_stop \"cost\" sizes chains; a draft tree is sized by tree_nodes and tree_depth "
                             "(set draft_stop = \"eta\", or tree_nodes = 0)")
        if self.chunking not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {', '.join(CHUNKING_MODES)}, got {self.chunking!r}")
        if self.chunk_tokens < 0 or self.pd_topk < 0 or self.up_bps < 0 or self.down_bps < 0 or self.draft_vocab < 0:
            raise ValueError("chunk_tokens, pd_topk, up_bps, down_bps and draft_vocab must be >= 0")
        if not 1.0 <= self.slowdown <= 100.0:
            raise ValueError(f"slowdown must be in [1, 100], got {self.slowdown}")


@dataclass(frozen=True)
class LinkConfig:
    """How the device reaches the cloud (edge_runtime.client.CloudClient is built from it whole) and what a request
    does when the link drops (edge_runtime.sessions.base.Session.resume)."""

    server: str = setting("tcp://127.0.0.1:5555", "the cloud's ZeroMQ endpoint (or a link emulator in front of it)")
    device_id: str = setting("edge-0", "shown in the cloud's logs")
    security: LinkSecurity = LinkSecurity()  # CurveZMQ keys (checked when connecting); plaintext only when asked
    connect_timeout_s: float = setting(5.0, "wait for the handshake reply per attempt")
    connect_retries: int = setting(3, "handshake attempts before giving up with a clear error",
                                   flag="--connect-retries", aliases=("--retries",))
    backoff_s: float = setting(0.5, "first retry delay, doubled per attempt (also between reconnections after a "
                               "drop)")
    request_timeout_s: float = setting(120.0, "one verify/generate round trip (a slow CPU target needs seconds)")
    heartbeat_s: float = setting(3.0, "ZMTP heartbeats: a link silent this long counts as dropped (then "
                                 "link_policy applies)")
    link_policy: str = setting("wait", "link drops mid-answer: \"wait\" (pause, reconnect, resume from the "
                               "history), \"degrade\" (keep generating with the device's own model meanwhile, "
                               "those tokens marked), \"fail\" (raise)", choices=LINK_POLICIES)
    reconnect_timeout_s: float = setting(300.0, "give up resuming after this long")

    def __post_init__(self) -> None:
        if not self.server.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"server must be a ZeroMQ endpoint like tcp://host:5555, got {self.server!r}")
        if self.connect_retries < 1:
            raise ValueError("connect_retries must be >= 1")
        if self.link_policy not in LINK_POLICIES:
            raise ValueError(f"link_policy must be one of {', '.join(LINK_POLICIES)}, got {self.link_policy!r}")
        for name in ("connect_timeout_s", "backoff_s", "request_timeout_s", "reconnect_timeout_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")

    @property
    def is_local(self) -> bool:
        """The server is on this machine (ipc, inproc, loopback or localhost TCP)."""
        return server_is_local(self.server)


@dataclass(frozen=True)
class EngineConfig:
    """What runs the draft on the device, and how: torch on the model, or a hat-export bundle's graphs."""

    backend: str = setting("torch", "what runs the draft: torch (the model) | onnxruntime | tensorrt (a hat-export "
                           "bundle) | llamacpp (the model's GGUF file, quantised as shipped, on llama.cpp: token "
                           "protocols only)", aliases=("--engine",), choices=BACKENDS)
    bundle: str = setting("", "hat-export bundle directory (onnxruntime / tensorrt)", metavar="DIR")
    precision: str = setting("fp32", "which of the bundle's artifacts: fp32 | fp16 | int8 | int4", choices=PRECISIONS)
    providers: tuple = setting((), "onnxruntime execution providers; () = available ones, TensorRT → CUDA → CPU",
                               metavar="EP,...")
    dtype: str = setting("float32", "draft model dtype: one-token forwards gain nothing from bfloat16 on CPU "
                         "(ARCHITECTURE.md)", choices=MODEL_DTYPES)
    device: str = setting("auto", "torch backend: where the model runs: auto (a CUDA GPU when present: a Jetson's) "
                          "| cpu | cuda | cuda:N (hat_split.models.placement); the bundle backends choose theirs "
                          "by providers / TensorRT", metavar="auto|cpu|cuda|cuda:N")
    threads: int = setting(0, "torch intra-op threads, or llama.cpp threads (llamacpp); 0 keeps their default "
                           "(every core)")
    weight_quant: str = setting("none", "\"int8\": dynamic int8 weights for the draft's linear layers (CPU; ~2x "
                                "faster drafts)", choices=WEIGHT_QUANTS)
    token_draft: str = setting("model", "what drafts for the token protocols: \"model\" (the whole model) | "
                               "\"adapter\" (the split draft output ∘ Λ ∘ input of split.adapter, for a device "
                               "holding only its parts of a large model)", choices=TOKEN_DRAFTS)
    n_ctx: int = setting(4096, "llamacpp: KV positions of the draft's context (the longest prompt + answer)")
    n_batch: int = setting(512, "llamacpp: tokens per llama_decode (a longer prompt is fed in several)")
    n_gpu_layers: int = setting(-1, "llamacpp: layers on the GPU of a CUDA build (a Jetson); -1 all; a CPU build "
                                "has none")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend in BUNDLE_BACKENDS and not self.bundle:
            raise ValueError(f"backend {self.backend} runs a hat-export bundle: give bundle (--bundle DIR)")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        check_device(self.device)
        if self.device != "auto" and self.backend not in ("torch",):
            raise ValueError(f"device applies to the torch backend; backend {self.backend} places itself "
                             f"(onnxruntime: providers, tensorrt: the GPU, llamacpp: n_gpu_layers)")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.weight_quant not in WEIGHT_QUANTS:
            raise ValueError(f"weight_quant must be one of {', '.join(WEIGHT_QUANTS)}, got {self.weight_quant!r}")
        if self.token_draft not in TOKEN_DRAFTS:
            raise ValueError(f"token_draft must be one of {', '.join(TOKEN_DRAFTS)}, got {self.token_draft!r}")
        if self.backend == "llamacpp" and self.token_draft != "model":
            raise ValueError("backend llamacpp drafts with the whole model (token_draft model): the adapter's draft "
                             "runs on torch or a bundle")
        if self.n_ctx < 8 or self.n_batch < 1:
            raise ValueError(f"n_ctx must be >= 8 positions and n_batch >= 1 tokens, got {self.n_ctx}, {self.n_batch}")
        if self.n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be >= 0, or -1 for every layer, got {self.n_gpu_layers}")


@dataclass(frozen=True)
class EdgeConfig:
    model: str = setting(help="registry short name, HF directory or .gguf path of the draft (small) model")
    device_profile: str = setting("", "hardware/devices name (e.g. agx-orin-64gb), reported to the cloud (HAT "
                                  "§3.2)")
    draft_len: int = setting(4, "γ, drafts per round for `sd` (`hlm` always drafts 1); the most when "
                             "draft_stop_prob > 0")
    draft_stop_prob: float = setting(0.0, "η: end a draft after a token with draft confidence < η (HAT eq. 5); 0 = "
                                     "fixed γ")
    tree_nodes: int = setting(0, "`sd` drafts a tree of at most this many nodes per round (hat_split.math.tree: "
                              "EAGLE-2's dynamic tree by path probability, verified in one cloud forward, exact at "
                              "every temperature; draft_stop_prob ends it where its main line would stop); 0: a "
                              "chain of draft_len (trees need the torch or llamacpp engine's model draft, or a "
                              "bundle's draft graphs, and a cloud that verifies them)")
    tree_depth: int = setting(6, "levels of a draft tree at most (the cloud's Welcome may allow fewer)")
    tree_width: int = setting(2, "new nodes per level of a draft tree, placed where the draft expects them "
                              "accepted most (the first child of the main line always: a tree holds the chain of "
                              "its depth)")
    auto_trees: str = setting("", "protocol auto: more draft-tree shapes sd may run, NODESxDEPTHxWIDTH comma "
                              "separated (e.g. 16x4x4,48x6x8), priced beside the chains and tree_nodes' tree: each "
                              "measured for a few rounds, then run where predicted fastest (docs/AUTO.md)")
    auto_eta: float = setting(0.4, "protocol auto: η of its η-chain, a candidate beside sd's chains: a chain of "
                              "up to sd's longest γ that ends after a draft token whose probability is below η (HAT "
                              "eq. 5), measured in place of sd's chain once sd is chosen (docs/AUTO.md); 0: none")
    auto_census: float = setting(0.25, "protocol auto: the share of requests, drawn at random whatever their prompt, "
                                 "whose draft model reads llm's tokens while the device waits even where sd could "
                                 "not win, and whose reads measure the prompts' acceptance (reads only where sd "
                                 "may win measure the promising prompts alone), so auto knows where sd would win "
                                 "over links where nothing drafts (docs/AUTO.md \"A census of the prompts\"); at "
                                 "temperature 0 more while the pool of its last 32 answers is not full (the share "
                                 "of it still empty: \"A larger census while the pool is small\"); the cost: those "
                                 "reads' device energy; 0: none")
    auto_record: str = setting("", "protocol auto: a JSON file of what auto measured on this device (acceptance, the "
                               "draft's and the device's times per power mode, round overheads, bytes, draft trees' "
                               "figures; edge_runtime.auto_record), read as the estimates of a runtime that has none "
                               "yet and written after every auto, sd and llm request, so a new runtime does not "
                               "measure every protocol again; \"\": none (each runtime measures afresh)")
    dist_dtype: str = setting("float16", "wire dtype of draft distributions; the draft is sampled from the rounded "
                              "values", choices=WIRE_DTYPES)
    dist_format: str = setting("auto", "\"dense\" | \"sparse\" | \"auto\" (smaller of the two); `hlm` always sends "
                               "dense", choices=DIST_FORMATS)
    llm_chunk: int = setting(8, "tokens per Generate round for `llm` (trades streaming granularity for round "
                             "trips)")
    overlap_prefill: str = setting("auto", "\"on\": draft prefill runs while the cloud prefills; \"off\": after; "
                                   "\"auto\": on unless the server is on this host (loopback / ipc), where the two "
                                   "processes would fight over the same cores", choices=OVERLAP_MODES)
    link: LinkConfig = LinkConfig()  # the cloud's address, security, timeouts, retries and what a drop does
    engine: EngineConfig = EngineConfig()  # what runs the draft (torch or a bundle) and how
    uncertainty: UncertaintyConfig = UncertaintyConfig()  # uhlm / randhlm / cuhlm
    qs: QSConfig = QSConfig()  # qs / ksqs / csqs / sq
    split: SplitConfig = SplitConfig()  # ushape / hat

    @property
    def overlaps_prefill(self) -> bool:
        if self.overlap_prefill != "auto":
            return self.overlap_prefill == "on"
        return not self.link.is_local

    @property
    def tree_shapes(self) -> List[Tuple[int, int, int]]:
        """sd's draft-tree shapes (nodes, depth, width): tree_nodes' first (if any), then auto_trees', each once."""
        out = [(self.tree_nodes, self.tree_depth, self.tree_width)] if self.tree_nodes else []
        for shape in parse_shapes(self.auto_trees):
            if shape not in out:
                out.append(shape)
        return out

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes any of sd's draft trees may have (0: chains only)."""
        return max((nodes for nodes, _, _ in self.tree_shapes), default=0)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EdgeConfig.model must name a model")
        if not 1 <= self.draft_len <= 64:
            raise ValueError(f"draft_len must be in 1..64, got {self.draft_len}")
        if not 0 <= self.tree_nodes <= 1024 or not 1 <= self.tree_depth <= 64 or not 1 <= self.tree_width <= 64:
            raise ValueError(f"tree_nodes must be in 0..1024, tree_depth and tree_width in 1..64; got "
                             f"{self.tree_nodes}, {self.tree_depth}, {self.tree_width}")
        for nodes, depth, width in parse_shapes(self.auto_trees):
            if nodes > 1024 or depth > 64 or width > 64:
                raise ValueError(f"auto_trees: {nodes}x{depth}x{width} is beyond 1024 nodes, 64 levels or 64 wide")
        if self.max_tree_nodes and self.engine.backend not in BUNDLE_BACKENDS and self.engine.token_draft != "model":
            raise ValueError("draft trees (tree_nodes > 0, auto_trees) run on the torch and llamacpp backends' draft "
                             "model (engine.token_draft model), or on a bundle's draft graphs (either token_draft)")
        if self.dist_dtype not in WIRE_DTYPES:
            raise ValueError(f"dist_dtype must be one of {WIRE_DTYPES}, got {self.dist_dtype!r}")
        if self.dist_format not in DIST_FORMATS:
            raise ValueError(f"dist_format must be dense, sparse or auto, got {self.dist_format!r}")
        if self.llm_chunk < 1:
            raise ValueError("llm_chunk must be >= 1")
        if not 0.0 <= self.draft_stop_prob < 1.0:
            raise ValueError(f"draft_stop_prob must be in [0, 1), got {self.draft_stop_prob}")
        if not 0.0 <= self.auto_eta < 1.0:
            raise ValueError(f"auto_eta must be in [0, 1), got {self.auto_eta}")
        if not 0.0 <= self.auto_census <= 1.0:  # NaN too
            raise ValueError(f"auto_census must be in [0, 1], got {self.auto_census}")
        if self.engine.token_draft == "adapter" and not self.split.adapter and self.engine.backend == "torch":
            raise ValueError("token_draft 'adapter' needs split.adapter (a hat-distill directory, --adapter)")
        if self.overlap_prefill not in OVERLAP_MODES:
            raise ValueError(f"overlap_prefill must be one of {', '.join(OVERLAP_MODES)}, got {self.overlap_prefill!r}")
        if self.device_profile:
            try:
                get_profile(self.device_profile)
            except ProfileError as exc:
                raise ValueError(str(exc)) from None


def server_is_local(endpoint: str) -> bool:
    """True when a ZeroMQ endpoint is on this machine (ipc, inproc, loopback or localhost TCP)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
