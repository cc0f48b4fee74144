"""`hat-bench fuzz`: malformed, truncated, oversized, reordered and replayed frames against the protocol decoder and a
running cloud server, beside a well-behaved device whose session must come out intact.

Cases start from valid requests of every kind (Hello, OpenSession, Verify with dense / sparse / top-k payloads,
Generate, CloseSession, OpenSplit, Hidden, Report, and replies a device never sends) and are mutated: bytes flipped,
truncated, frames dropped / duplicated / swapped / appended, oversized, garbage headers, wrong magic or version,
fields of the wrong type or range, or replayed from earlier cases (same session ids and steps). Each case goes
  1. to `protocol.decode`: it must return a message or raise ProtocolError, nothing else;
  2. over a real DEALER socket to a `hat-cloud serve` process on a rig (profiles.bench.rig; a small random
     model saved for the run): every case must be answered, a bad one with an Error, and no handler may fail
     internally (`internal` errors count as bugs).
Meanwhile a legitimate device (an edge runtime on the rig, its own identity, the target as its draft) generates
with `sd` every `--check-every` cases; its tokens must equal the target's greedy tokens every time: fuzzing never
corrupts another session. Writes JSON with the counts.

`--stateful` (profiles.bench.fuzz_state): instead of mutating single requests at random, the fuzzer opens sessions
properly, tracks their state from the replies and mutates requests relative to it, so cases reach every handler past
its checks; the report adds the coverage: per request type, each reply type and error code.
"""
from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import Counter
from typing import Any, Dict, List

import msgspec
import numpy as np
import zmq

from edge_runtime.config import EdgeConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.math.sampling import SamplingParams
from hat_split.models.lm import CausalLM
from hat_split.models.loading import vocab_fingerprint
from hat_split.wire import messages as P
from profiles.bench.fuzz_state import Facts, coverage_table, run_stateful
from profiles.bench.rig import Rig
from profiles.bench.provenance import write_report

VOCAB = 256
MUTATIONS = ("valid", "flip", "truncate", "drop_frame", "extra_frame", "duplicate_frame", "swap_frames", "oversize",
             "garbage", "bad_magic", "bad_version", "header_junk", "wrong_types", "replay")


def add_parser(sub) -> None:
    s = sub.add_parser("fuzz", help="fuzz the protocol decoder and a running server (malformed/replayed frames)")
    s.add_argument("--cases", type=int, default=100_000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--check-every", type=int, default=2000, help="cases between the legitimate device's checks")
    s.add_argument("--stateful", action="store_true",
                   help="open sessions properly, mutate requests relative to their state (profiles.bench.fuzz_state)")
    s.add_argument("--out", default="runs/fuzz.json")


def valid_requests(rng: random.Random, vocab: str) -> List[P.Message]:
    """One valid request of each kind (and replies a device never sends), with random ids and sizes; `vocab`: the
    served model's vocabulary fingerprint."""
    sid, step = rng.randrange(0, 50), rng.randrange(0, 20)
    n = rng.randrange(1, 6)
    toks = lambda k: np.asarray([rng.randrange(VOCAB) for _ in range(k)], np.int32)  # noqa: E731
    dense = np.full((n, VOCAB), 1.0 / VOCAB, np.float16)
    sparse = P.DistPayload("sparse", np.full(n, 1.0, np.float16), toks(n), np.arange(n + 1, dtype=np.int64))
    hidden = P.HiddenPayload("float16", np.zeros((n, 64), np.float16))
    return [
        P.Hello(f"fuzz-{rng.randrange(9)}", "tiny", VOCAB, vocab),
        P.OpenSession(sid, rng.choice(["sd", "hlm", "llm", "nope"]), toks(rng.randrange(1, 30)),
                      P.Sampling(rng.choice([0.0, 1.0]))),
        P.Verify(sid, step, rng.randrange(0, 40), toks(rng.randrange(0, 3)), toks(n), P.DistPayload("dense", dense)),
        P.Verify(sid, step, rng.randrange(0, 40), toks(0), toks(n), sparse),
        P.Generate(sid, step, rng.randrange(0, 40), toks(0), rng.randrange(1, 5)),
        P.CloseSession(sid, None, None, rng.randrange(0, 40)),
        P.OpenSplit(sid, "hat", "f" * 32, 1, 2, "float16", rng.randrange(1, 30)),
        P.Hidden(sid, step, rng.randrange(0, 40), hidden, rng.randrange(0, n + 1)),
        P.Report(P.DeviceState(1e6, 1e6, 0.01, "MODE_30W"),
                 P.DeviceStats("ready", "torch", "tiny", 3, {"sd": 2, "hat": 1}, 40.0, 0.2, 0.03, 0.7, 1, 7.5)),
        P.Verdict(sid, step, 0, 1, 0, 0.0),
    ]


def mutate(frames: List[bytes], kind: str, rng: random.Random, history: List[List[bytes]]) -> List[bytes]:
    frames = [bytes(f) for f in frames]
    if kind == "valid":
        return frames
    if kind == "replay" and history:
        return list(rng.choice(history))
    if kind == "flip":
        i = rng.randrange(len(frames))
        f = bytearray(frames[i] or b"\0")
        for _ in range(rng.randrange(1, 8)):
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(f)
    elif kind == "truncate":
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    elif kind == "drop_frame" and len(frames) > 1:
        del frames[rng.randrange(1, len(frames))]
    elif kind == "extra_frame":
        frames.append(os.urandom(rng.randrange(0, 64)))
    elif kind == "duplicate_frame":
        i = rng.randrange(len(frames))
        frames.insert(i, frames[i])
    elif kind == "swap_frames" and len(frames) > 1:
        i, j = rng.sample(range(len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]
    elif kind == "oversize":
        frames.append(b"\0" * (P.DEFAULT_MAX_MESSAGE_BYTES + 1))
    elif kind == "garbage":
        frames = [os.urandom(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 4))]
    elif kind == "bad_magic":
        frames[0] = b"XYZ" + frames[0][3:]
    elif kind == "bad_version":
        frames[0] = frames[0][:3] + bytes([rng.choice([0, 2, 255])]) + frames[0][4:]
    elif kind == "header_junk":
        frames[0] = frames[0][:4] + os.urandom(rng.randrange(1, 100))
    elif kind == "wrong_types":
        head = msgspec.msgpack.decode(frames[0][4:])
        if isinstance(head, dict):
            key = rng.choice([k for k in head if k != "type"] or ["type"])
            head[key] = rng.choice([-1, 2**40, "x", None, [], {"a": 1}, 1.5, True])
        frames[0] = frames[0][:4] + msgspec.msgpack.encode(head)
    return frames


def fuzz_decoder(frames: List[bytes]) -> str:
    """'ok:<Type>' or 'error:<code>'; anything else raised is a bug and propagates."""
    try:
        return f"ok:{type(P.decode(frames)).__name__}"
    except P.ProtocolError as exc:
        return f"error:{exc.code}"


def tiny_target(path: str, seed: int = 0):
    """A small random Qwen2 (64 hidden, 2 layers, 256 tokens) and a word-level tokenizer over its vocabulary, saved to
    `path` for a cloud process: plumbing only, its outputs mean nothing. Returns (CausalLM, vocabulary fingerprint)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    words = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}, "<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    saved = AutoTokenizer.from_pretrained(path)  # what the cloud loads: a Qwen2 tokenizer adds <|endoftext|>
    return CausalLM(model), vocab_fingerprint(saved)


def legitimate_run(rt: EdgeRuntime, prompt: List[int], n: int) -> List[int]:
    """A well-behaved device: sd with the target as its own draft, greedy (so its tokens are the target's)."""
    return rt.generate(prompt, "sd", SamplingParams(0.0), n, seed=0).tokens


def greedy(lm, prompt: List[int], n: int) -> List[int]:
    state, out = lm.new_state(), []
    logits = lm.forward(state, prompt)
    for _ in range(n):
        out.append(int(np.argmax(logits[-1])))
        logits = lm.forward(state, [out[-1]])
    return out


def fuzz(cases: int, seed: int = 0, check_every: int = 2000, progress: bool = True,
         stateful: bool = False) -> Dict[str, Any]:
    rng = random.Random(seed)
    report: Dict[str, Any] = {"cases": cases, "seed": seed, "decoder": Counter(), "server": Counter(),
                              "bugs": [], "unanswered": 0, "legit_checks": 0, "legit_mismatches": 0}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hatspec-fuzz-") as tmp:
        lm, vocab = tiny_target(os.path.join(tmp, "tiny"), seed)
        prompt = [rng.randrange(VOCAB) for _ in range(12)]
        reference = greedy(lm, prompt, 16)
        stats_path = os.path.join(tmp, "stats.json")
        cloud_args = ["--dtype", "float32", "--max-context", "1024", "--stats-json", stats_path]
        with Rig(os.path.join(tmp, "tiny"), cloud_args=cloud_args, threads=1) as bed:
            legit = bed.runtime(EdgeConfig(model=os.path.join(tmp, "tiny"), link=bed.link_config("legit")))
            if stateful:
                _stateful_cases(bed.endpoint, cases, rng, lm, vocab, legit, prompt, reference, check_every, progress,
                                report, t0)
            else:
                _fuzz_cases(bed.endpoint, cases, rng, vocab, legit, prompt, reference, check_every, progress, report,
                            t0)
            report["server_alive"] = bed.cloud.proc.poll() is None
        with open(stats_path, encoding="utf-8") as f:  # written by the cloud as it stopped
            report["server_stats"] = json.load(f)["server"]
    report["seconds"] = time.perf_counter() - t0
    report["decoder"], report["server"] = dict(report["decoder"]), dict(report["server"])
    return report


def _fuzz_cases(endpoint: str, cases: int, rng: random.Random, vocab: str, legit: EdgeRuntime, prompt: List[int],
                reference: List[int], check_every: int, progress: bool, report: Dict[str, Any], t0: float) -> None:
    """Every case to the decoder and over one DEALER socket to the server; the legitimate device between them."""
    ctx = zmq.Context.instance()

    def dealer() -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    def legit_check() -> None:
        report["legit_checks"] += 1
        if legitimate_run(legit, prompt, 16) != reference:
            report["legit_mismatches"] += 1

    sock = dealer()
    history: List[List[bytes]] = []
    pool: List[List[bytes]] = []
    try:
        for i in range(cases):
            if i % 50 == 0:
                pool = [list(map(bytes, P.encode(m))) for m in valid_requests(rng, vocab)]
            kind = rng.choice(MUTATIONS)
            frames = mutate(rng.choice(pool), kind, rng, history)
            try:
                report["decoder"][f"{kind} {fuzz_decoder(frames)}"] += 1
            except Exception as exc:  # a decoder that raises anything but ProtocolError is a bug
                report["bugs"].append({"case": i, "where": "decoder", "kind": kind, "error": repr(exc)[:300]})
            history = (history + [frames])[-64:]
            sock.send_multipart(frames)
            if not sock.poll(5000):
                report["unanswered"] += 1
                report["bugs"].append({"case": i, "where": "server", "kind": kind, "error": "no answer in 5 s"})
                sock.close(linger=0)  # a fresh identity: the old one may have a reply still to come
                sock = dealer()
                continue
            reply = P.decode(sock.recv_multipart())
            outcome = f"error:{reply.code}" if isinstance(reply, P.Error) else f"ok:{type(reply).__name__}"
            report["server"][f"{kind} {outcome}"] += 1
            if isinstance(reply, P.Error) and reply.code == "internal":
                report["bugs"].append({"case": i, "where": "server", "kind": kind, "error": reply.message[:300]})
            if check_every and (i + 1) % check_every == 0:
                legit_check()
                if progress:
                    print(f"  {i + 1}/{cases} cases, {len(report['bugs'])} bugs, "
                          f"{time.perf_counter() - t0:.0f} s", flush=True)
        legit_check()
    finally:
        sock.close(linger=0)


def _stateful_cases(endpoint: str, cases: int, rng: random.Random, lm: CausalLM, vocab: str, legit: EdgeRuntime,
                    prompt: List[int], reference: List[int], check_every: int, progress: bool, report: Dict[str, Any],
                    t0: float) -> None:
    """profiles.bench.fuzz_state's cases from one fuzzing device; the legitimate device between them."""
    from hat_split.models.partition import model_fingerprint

    cfg = lm.model.config
    facts = Facts(VOCAB, vocab, model_fingerprint(lm.model), cfg.num_hidden_layers, cfg.hidden_size)

    def between(i: int) -> None:
        if check_every and (i + 1) % check_every == 0 or i + 1 == cases:
            report["legit_checks"] += 1
            report["legit_mismatches"] += legitimate_run(legit, prompt, 16) != reference
            if progress:
                print(f"  {i + 1}/{cases} cases, {len(report['bugs'])} bugs, {time.perf_counter() - t0:.0f} s",
                      flush=True)

    run_stateful(endpoint, facts, cases, rng, report, between)


def run(args) -> int:
    report = fuzz(args.cases, args.seed, args.check_every, stateful=args.stateful)
    write_report(args.out, report)
    errors = Counter()
    for key, count in report["server"].items():
        errors[key.split(" ", 1)[1]] += count
    for outcomes in report.get("coverage", {}).values():  # --stateful
        errors.update(outcomes)
    print(f"hat-bench fuzz: {args.cases} cases in {report['seconds']:.0f} s; server answers: "
          f"{dict(errors.most_common(8))}; bugs {len(report['bugs'])}, unanswered {report['unanswered']}, "
          f"legitimate session checks {report['legit_checks']} with {report['legit_mismatches']} mismatches; "
          f"wrote {args.out}")
    if args.stateful:
        print(coverage_table(report["coverage"]))
        print(f"deepest state reached: {report['deepest']}")
    return 1 if report["bugs"] or report["legit_mismatches"] or not report["server_alive"] else 0

