"""The device's model, opened in one place: `open_engine(config)` gives one object with what every request needs —
the whole-model draft `lm` of the token protocols, the tokenizer, the vocabulary size and fingerprint, the model's
name and end tokens — and, beside them, the parts the split protocols and the adapter's draft run on, built on first
use and kept (`token_lm`, `split_parts`).

Three engines (EngineConfig.backend): torch on the model (`TorchEngine`, which cuts it at split.m), a hat-export
bundle's graphs on onnxruntime or TensorRT (`BundleEngine`), or the model's GGUF file on llama.cpp (`LlamaCppEngine`,
token protocols only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from edge_runtime.backends.loader import open_bundle
from edge_runtime.backends.split_parts import TorchSplitParts
from edge_runtime.config import EdgeConfig, SplitConfig
from hat_split.extras import need
from hat_split.files.bundle import BundleError
from hat_split.models.llamacpp_lm import LlamaCppLM, LlamaCppSettings, max_sequences, model_gguf
from hat_split.models.lm import CausalLM
from hat_split.models.loading import eos_ids, load_model, load_tokenizer, quantize_weights, vocab_fingerprint
from hat_split.models.partition import SplitModel, holds_all_layers
from hat_split.models.placement import resolve_device
from hat_split.models.registry import MODELS, get_model_spec


@dataclass
class Engine:
    """What one device's model is, whatever runs it."""

    lm: Any  # the whole model as the token protocols' draft; None for a bundle of split parts only
    tokenizer: Any
    vocab_size: int
    model_name: str
    fingerprint: str  # the vocabulary's (hat_split.models.loading.vocab_fingerprint): the cloud's must match
    eos_ids: frozenset

    def token_lm(self, config: EdgeConfig) -> Any:
        """The token protocols' draft (engine.token_draft: the whole model, or the adapter's split draft)."""
        return self.lm

    def split_parts(self, hat: bool, split: SplitConfig) -> Any:
        """The device's parts of the model for the split protocols (and Λ for `hat`), built once per
        (hat, draft vocabulary): edge_runtime.backends.split_parts."""
        raise ValueError(f"the split protocols (ushape, hat) and the adapter's draft run on the torch engine or a "
                         f"hat-export bundle; this device runs {type(self).__name__.replace('Engine', '').lower()}")


@dataclass
class LlamaCppEngine(Engine):
    pass


@dataclass
class BundleEngine(Engine):
    bundle: Any = None  # edge_runtime.backends.loader.Bundle: its part runners open on first use and stay
    _parts: Dict[str, Any] = field(default_factory=dict)

    def token_lm(self, config: EdgeConfig) -> Any:
        return self.lm if self.lm is not None else self.bundle.draft_lm()  # the latter says what is missing

    def split_parts(self, hat: bool, split: SplitConfig) -> Any:
        drafter = self._drafter(split) if hat else ""
        if drafter not in self._parts:
            self._parts[drafter] = self.bundle.split_parts(drafter)
        return self._parts[drafter]

    def _drafter(self, split: SplitConfig) -> str:
        """The bundle's draft part protocol hat runs: the kind in split.adapter's directory when given (it must be
        exported into the bundle), else the best the bundle holds; split.draft_vocab must be the one exported."""
        held = self.bundle.drafters()
        want = ""
        if split.adapter:
            want = "feature" if (Path(split.adapter) / "drafter.json").is_file() else "adapter"
        if not held or (want and want not in held):
            what = {"feature": "the feature drafter", "adapter": "Λ", "": "a draft part"}[want]
            parts = "hat-feature" if want == "feature" else "hat"
            raise ValueError(f"the bundle {self.bundle.root} holds no {what}: export it with hat-export onnx --parts "
                             f"{parts} --adapter DIR")
        drafter = want or held[0]
        exported = int(self.bundle.manifest.model.get("draft_vocab") or 0) if drafter == "feature" else 0
        if split.draft_vocab and split.draft_vocab != exported:
            raise ValueError(f"split.draft_vocab is {split.draft_vocab}, but the bundle's {drafter} part drafts over "
                             + (f"{exported} tokens" if exported else "the whole head")
                             + " (a bundle's draft vocabulary is fixed at export: hat-export onnx --draft-vocab N)")
        return drafter


@dataclass
class TorchEngine(Engine):
    loaded: Any = None  # hat_split.models.loading.LoadedModel
    _split: Optional[SplitModel] = None  # the model cut at split.m, on first use
    _adapters: Dict[str, Any] = field(default_factory=dict)  # draft modules (Λ or feature drafters) by directory
    _adapter_lm: Any = None  # hat_split.models.draft_lm.AdapterLM when token_draft is "adapter"
    _tree_lm: Any = None  # hat_split.models.tree_lm.TreeLM when drafts are trees
    _parts: Dict[Tuple[bool, str, int], TorchSplitParts] = field(default_factory=dict)

    def token_lm(self, config: EdgeConfig) -> Any:
        if config.engine.token_draft == "model" and config.max_tree_nodes:
            if self._tree_lm is None:  # the same weights run as one Stack: chains and trees (hat_split.models.tree_lm)
                from hat_split.models.tree_lm import TreeLM  # torch

                self._tree_lm = TreeLM(self.lm.model)
            return self._tree_lm
        if config.engine.token_draft == "model":
            return self.lm
        if self._adapter_lm is None:
            from hat_split.models.draft_lm import AdapterLM  # torch
            from hat_split.models.feature_drafter import FeatureDrafter

            cut, adapter = self._cut(config.split, adapter=True)
            if isinstance(adapter, FeatureDrafter):
                raise ValueError(f"token_draft adapter drafts with Λ; {config.split.adapter} holds a feature drafter, "
                                 "which drafts in protocol hat only")
            self._adapter_lm = AdapterLM(cut, adapter, slowdown=config.split.slowdown)
            self._adapter_lm.warm_up()
        return self._adapter_lm

    def split_parts(self, hat: bool, split: SplitConfig) -> TorchSplitParts:
        # the config may change between requests (hat-bench's rows): the parts are kept per draft module and vocabulary
        key = (hat, split.adapter if hat else "", split.draft_vocab if hat else 0)
        if key not in self._parts:
            from hat_split.models.adapter import load_draft_vocab

            cut, adapter = self._cut(split, adapter=hat)
            ids = load_draft_vocab(split.adapter, split.draft_vocab) if key[2] else None
            self._parts[key] = TorchSplitParts(cut, adapter if hat else None, ids)
        return self._parts[key]

    def _cut(self, split: SplitConfig, adapter: bool):
        """The model cut at split.m (and, when asked, its draft module: Λ or the feature drafter), built once."""
        from hat_split.models.feature_drafter import load_drafter  # torch

        if self._split is None:
            self._split = SplitModel(self.loaded.model, split.m, split.tail)
        if not adapter:
            return self._split, None
        if not split.adapter:
            raise ValueError("protocol hat needs a distilled adapter: pass --adapter DIR (make one with hat-distill)")
        if split.adapter not in self._adapters:
            self._adapters[split.adapter] = load_drafter(split.adapter, self._split)
        return self._split, self._adapters[split.adapter]


def open_engine(config: EdgeConfig, loaded: Any = None) -> Engine:
    """The device's model as `config.engine` says, warmed up. `loaded`: a torch model already in memory
    (hat_split.models.loading.load_model), e.g. one shared by several emulated devices in one process, or an Engine
    already made (a bench's played-back draft: profiles.bench.recorded_draft), taken as it is."""
    if isinstance(loaded, Engine):
        return loaded
    engine = config.engine
    if engine.backend != "torch" and loaded is not None:
        what = "the model's GGUF file" if engine.backend == "llamacpp" else "a bundle"
        raise ValueError(f"backend {engine.backend} runs {what}; it takes no pre-loaded torch model")
    if engine.backend == "llamacpp":  # the model's GGUF file on llama.cpp: no torch model on the device
        # sequences: a request's drafter state and the next one's overlap for a moment (a state's id is freed when it
        # is dropped), and two of them a draft tree's paths (at most one per node; room for 64-node trees whatever
        # this request's tree_nodes, as later requests may change it); they share the n_ctx positions
        most, nodes = max_sequences(), config.max_tree_nodes
        if 4 + 2 * nodes > most:
            raise ValueError(f"draft trees of {nodes} nodes need {4 + 2 * nodes} llama.cpp sequences, this build has "
                             f"{most}: fewer tree_nodes (or smaller auto_trees)")
        seqs = min(most, 4 + 2 * max(nodes, 64))
        lm = LlamaCppLM(model_gguf(config.model), LlamaCppSettings(engine.n_ctx, engine.n_batch, engine.threads,
                                                                   n_seq_max=seqs, n_gpu_layers=engine.n_gpu_layers))
        tokenizer = load_tokenizer(config.model)
        name = get_model_spec(config.model).name if config.model in MODELS else str(config.model)
        lm.warm_up()
        return LlamaCppEngine(lm, tokenizer, lm.vocab_size, name, vocab_fingerprint(tokenizer),
                              frozenset(lm.eog_ids()))
    if engine.backend != "torch":  # exported artifacts: no torch model on the device
        bundle = open_bundle(config)
        model = bundle.manifest.model
        return BundleEngine(_bundle_draft(bundle), bundle.tokenizer, model["vocab"], model["name"],
                            model["vocab_fingerprint"], frozenset(model.get("eos_ids", [])), bundle=bundle)
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
    lm = CausalLM(loaded.model)
    if holds_all_layers(loaded.model):  # a model holding only its split parts runs no whole pass
        lm.warm_up()
    name = loaded.spec.name if loaded.spec is not None else str(config.model)
    return TorchEngine(lm, loaded.tokenizer, lm.vocab_size, name, vocab_fingerprint(loaded.tokenizer),
                       frozenset(eos_ids(loaded.model, loaded.tokenizer)), loaded=loaded)


def _bundle_draft(bundle: Any) -> Any:
    """A bundle's draft chain for the token protocols, opened and warmed up now if the bundle has it; a bundle of
    split parts only (hat-export --parts hat) opens it on demand, so asking a token protocol says what is missing."""
    try:
        lm = bundle.draft_lm()
    except BundleError:
        return None
    lm.warm_up()
    return lm
