"""`hat-train-policy`: learn the (draft length L, lattice resolution ℓ) policy of QS-SD §IV offline.

    hat-train-policy record --out runs/policy_traces.npz     # real pair, real prompts (calibration split)
    hat-train-policy train --traces runs/policy_traces.npz --out runs/policy.npz

`record` runs the draft and target models in this process along real generations (speculative decoding with
L_max drafts per round, exact verification by TargetDriver, on the cloud's own TargetState) and stores, per round,
the acceptance probability of every draft at every resolution of the action set, the draft's confidences and the
measured model times (edge_runtime.policy.env.Trace). `train` fits a double DQN (online and target Q-networks, replay,
ε-greedy; reward = expected new tokens / round time, QS-SD eq. 13) in edge_runtime.policy.env's two-state Markov
uplink, then compares it on held-out traces with the static and heuristic policies, and saves the network for
`hat-edge --policy dqn --policy-file …` (numpy only on the device).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from edge_runtime.drafter import Drafter
from edge_runtime.policy.env import PolicyEnv, RoundCost, Trace, TwoStateChannel, action_grid, throughput
from edge_runtime.policy.policies import N_FEATURES, HeuristicPolicy, QNetwork
from hat_split.math.enumerative import composition_bits, field_bits
from hat_split.math.lattice import nearest
from hat_split.math.rng import session_rng
from hat_split.math.sampling import SamplingParams
from hat_split.models.chat import encode
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_pair
from hat_split.models.target import TargetDriver
from hat_split.prompt_sets import calibration_prompts
from hat_split.wire import messages as P

DEFAULT_ELLS = (4, 16, 64, 256)
DEFAULT_LENGTHS = (1, 2, 3, 4, 6, 8)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-train-policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="log acceptance traces on the real pair")
    r.add_argument("--draft", default="qwen2.5-coder-0.5b")
    r.add_argument("--target", default="qwen2.5-coder-1.5b")
    r.add_argument("--prompts", type=int, default=8, help="calibration prompts (disjoint from evaluation prompts)")
    r.add_argument("--max-new-tokens", type=int, default=48)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--max-len", type=int, default=max(DEFAULT_LENGTHS), help="L_max drafted per recorded round")
    r.add_argument("--ells", default=",".join(map(str, DEFAULT_ELLS)), help="resolutions of the action set")
    r.add_argument("--weight-quant", default="int8", choices=["none", "int8"])
    r.add_argument("--target-dtype", default="auto", help="the target's dtype (auto: bfloat16 where the CPU has it)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default="runs/policy_traces.npz")
    t = sub.add_parser("train", help="train the double DQN on recorded traces")
    t.add_argument("--traces", default="runs/policy_traces.npz")
    t.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="draft lengths of the action set")
    t.add_argument("--low-rate", type=float, default=350e3, help="uplink bit/s in the low state (QS-SD: 350 kbit/s)")
    t.add_argument("--high-rate", type=float, default=4e6, help="uplink bit/s in the high state (QS-SD: 4 Mbit/s)")
    t.add_argument("--p-switch", type=float, default=0.2, help="per-round probability of changing state")
    t.add_argument("--rtt", type=float, default=0.01, help="propagation both ways + reply, seconds")
    t.add_argument("--steps", type=int, default=20000)
    t.add_argument("--gamma", type=float, default=0.5, help="discount: the action barely moves the next state")
    t.add_argument("--hidden", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="runs/policy.npz")
    return ap


def _ints(text: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


# -- record ------------------------------------------------------------------------------------------------------------
def record_traces(d_lm, t_lm, prompts, params, ells, max_len, max_new_tokens, eos=frozenset(), seed=0, log=print):
    """One Trace per prompt (token id lists) from the real pair."""

    traces = []
    for i, ids in enumerate(prompts):
        rng = session_rng(seed * 1000 + i, "device")
        drafter = Drafter(d_lm, params)
        session = TargetDriver(t_lm, i, "sd", params, seed * 1000 + i, list(ids))
        session.prefill()
        drafter.start(ids)
        accept, conf, n_out, draft_s, verify_s, drafted = [], [], 0, 0.0, 0.0, 0
        while n_out < max_new_tokens:
            f0, c0 = drafter.kv.forward_s, session.compute_s
            drafts, _ = drafter.draft(max_len, rng)
            q = np.stack(drafter.last_q)  # [L, vocab]
            n, token = session.verify([], drafts, q)
            draft_s += drafter.kv.forward_s - f0
            verify_s += session.compute_s - c0
            drafted += len(drafts)
            p = session.last_p[: len(drafts)]  # [L, vocab]
            a = np.empty((len(ells), len(drafts)))
            for e, ell in enumerate(ells):
                q_hat = nearest(q, ell) / ell  # [L, vocab]
                a[e] = np.minimum(p, q_hat).sum(axis=1)
            accept.append(a)
            conf.append([q[j, t] for j, t in enumerate(drafts)])
            committed = drafts[:n] + [token]
            drafter.commit(committed, n)
            n_out += len(committed)
            if any(t in eos for t in committed):
                break
        traces.append(Trace(np.clip(np.array(accept), 0, 1), np.array(conf), draft_s / drafted,
                            verify_s / len(accept)))
        log(f"  prompt {i + 1}/{len(prompts)}: {len(accept)} rounds, {n_out} tokens, "
            f"draft {1e3 * traces[-1].draft_s:.0f} ms/token, verify {1e3 * traces[-1].verify_s:.0f} ms")
    return traces


def save_traces(path: str, traces, ells, meta: dict) -> None:
    arrays = {}
    for i, t in enumerate(traces):
        arrays[f"accept{i}"], arrays[f"confidence{i}"] = t.accept, t.confidence
        arrays[f"times{i}"] = np.array([t.draft_s, t.verify_s])
    np.savez_compressed(path, ells=np.array(ells), meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)


def load_traces(path: str):
    try:
        with np.load(path, allow_pickle=False) as f:
            n = sum(1 for k in f.files if k.startswith("accept"))
            traces = [Trace(f[f"accept{i}"], f[f"confidence{i}"], *map(float, f[f"times{i}"])) for i in range(n)]
            return traces, tuple(int(x) for x in f["ells"]), json.loads(f["meta"].tobytes().decode())
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a hat-train-policy trace file ({exc})") from None


def cmd_record(args) -> int:
    ells = _ints(args.ells)
    prompts = calibration_prompts(args.prompts)
    draft, target, eos = load_pair(args.draft, args.target, args.weight_quant, args.target_dtype)
    t0 = time.perf_counter()
    d_lm = CausalLM(draft.model)
    traces = record_traces(d_lm, CausalLM(target.model),
                           [encode(draft.tokenizer, p.text, p.chat) for p in prompts],
                           SamplingParams(args.temperature), ells, args.max_len, args.max_new_tokens, eos, args.seed)
    save_traces(args.out, traces, ells, {"draft": args.draft, "target": args.target, "vocab_size": d_lm.vocab_size,
                                         "temperature": args.temperature, "seconds": time.perf_counter() - t0})
    print(f"hat-train-policy: {sum(t.accept.shape[0] for t in traces)} rounds from {len(traces)} prompts "
          f"in {time.perf_counter() - t0:.0f} s → {args.out}")
    return 0


# -- train -------------------------------------------------------------------------------------------------------------
def round_cost(vocab_size: int, ells, rtt_s: float):
    """The real Verify frame's fixed bytes and each resolution's row bits (hat_split.math.enumerative)."""

    empty = P.DistPayload("lattice", np.zeros(0, np.uint8), bits=0, ell=max(ells), k=vocab_size)
    frame = P.frame_bytes(P.encode(P.Verify(1, 1, 1000, np.zeros(0, np.int32), np.zeros(0, np.int32), empty, 0.01)))
    return RoundCost(tuple(composition_bits(vocab_size, ell) for ell in ells), 8 * frame, 32, rtt_s), \
        field_bits(vocab_size)


def train_dqn(env, steps: int, gamma: float, hidden: int, seed: int, log=print):
    """Double DQN (van Hasselt et al.): the online net picks the next action, the target net values it."""
    import torch

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    n_actions = len(env.actions)
    # Feature scaling from states visited by a random policy.
    feats, state, done = [], env.reset(), False
    for _ in range(2000):
        state, _, done, _ = env.step(int(rng.integers(n_actions)))
        feats.append(state.features())
        if done:
            state = env.reset()
    feats = np.array(feats)
    mean, std = feats.mean(axis=0), np.maximum(feats.std(axis=0), 1e-3)

    def net():
        return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_actions))

    online, target = net(), net()
    target.load_state_dict(online.state_dict())
    opt = torch.optim.Adam(online.parameters(), lr=1e-3)
    scale = lambda x: torch.as_tensor((np.asarray(x) - mean) / std, dtype=torch.float32)  # noqa: E731
    buf_s, buf_a, buf_r, buf_s2, buf_d = [], [], [], [], []
    state = env.reset()
    for step in range(steps):
        eps = max(0.05, 1.0 - step / (0.5 * steps))
        s = state.features()
        if rng.random() < eps:
            a = int(rng.integers(n_actions))
        else:
            with torch.no_grad():
                a = int(online(scale(s)[None]).argmax())
        state, r, done, _ = env.step(a)
        # log of eq. 13: a slow-link round earns ~50x less than a fast one; on the log scale both weigh alike, and
        # the best action of a round is the same
        buf_s.append(s), buf_a.append(a), buf_r.append(math.log(max(r, 1e-9))), buf_s2.append(state.features())
        buf_d.append(float(done))
        if done:
            state = env.reset()
        if len(buf_s) >= 256:
            idx = rng.integers(len(buf_s), size=64)
            sb, s2b = scale(np.array(buf_s)[idx]), scale(np.array(buf_s2)[idx])
            ab = torch.as_tensor(np.array(buf_a)[idx])
            rb = torch.as_tensor(np.array(buf_r)[idx], dtype=torch.float32)
            db = torch.as_tensor(np.array(buf_d)[idx], dtype=torch.float32)
            with torch.no_grad():
                best = online(s2b).argmax(dim=1, keepdim=True)
                y = rb + gamma * (1 - db) * target(s2b).gather(1, best).squeeze(1)
            q = online(sb).gather(1, ab[:, None]).squeeze(1)
            loss = torch.nn.functional.smooth_l1_loss(q, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if step % 500 == 0:
            target.load_state_dict(online.state_dict())
        if len(buf_s) > 50_000:
            del buf_s[:10_000], buf_a[:10_000], buf_r[:10_000], buf_s2[:10_000], buf_d[:10_000]
        if step and step % max(1, steps // 5) == 0:
            log(f"  step {step}/{steps}, ε {eps:.2f}")
    layers = [m for m in online if isinstance(m, torch.nn.Linear)]
    return QNetwork([m.weight.detach().numpy().T.astype(np.float64).copy() for m in layers],
                    [m.bias.detach().numpy().astype(np.float64).copy() for m in layers],
                    np.zeros((n_actions, 2), np.int64), mean, std, {})


def evaluate(env, net, ells, lengths, episodes, static=(4, 2)) -> dict:
    """Throughput (tokens/s) of the DQN, the static (L, ℓ) and the heuristic on the same held-out traces."""

    index = {(int(L), int(e)): i for i, (L, e) in enumerate(env.actions)}
    out = {"dqn": throughput(env, lambda s: int(np.argmax(net.q_values(s.features()))), episodes)}
    L0, e0 = static
    out[f"static L={L0} ℓ={ells[e0]}"] = throughput(env, lambda s: index[(L0, e0)], episodes)
    heur = HeuristicPolicy(L0, ells[e0], max(lengths))
    nearest_len = lambda L: min(lengths, key=lambda x: abs(x - L))  # noqa: E731
    out[f"heuristic ℓ={ells[e0]}"] = throughput(env, lambda s: index[(nearest_len(heur.draft_len), e0)], episodes,
                                                observe=heur.observe)
    return out


def cmd_train(args) -> int:
    traces, ells, meta = load_traces(args.traces)
    lengths = _ints(args.lengths)
    if len(traces) < 2:
        raise ValueError("need traces of at least 2 prompts (one is held out)")
    cost, _ = round_cost(int(meta["vocab_size"]), ells, args.rtt)
    actions = action_grid(lengths, len(ells))
    n_train = max(1, int(round(0.75 * len(traces))))
    channel = TwoStateChannel(args.low_rate, args.high_rate, args.p_switch, args.p_switch)
    env = PolicyEnv(traces[:n_train], actions, cost, channel, args.seed)
    t0 = time.perf_counter()
    net = train_dqn(env, args.steps, args.gamma, args.hidden, args.seed)
    net.actions = np.array([(L, ells[e]) for L, e in actions], dtype=np.int64)
    net.meta = {**meta, "ells": list(ells), "lengths": list(lengths), "low_rate": args.low_rate,
                "high_rate": args.high_rate, "p_switch": args.p_switch, "steps": args.steps,
                "train_prompts": n_train, "seconds": time.perf_counter() - t0}
    held = PolicyEnv(traces[n_train:], actions, cost, TwoStateChannel(args.low_rate, args.high_rate, args.p_switch,
                                                                       args.p_switch), args.seed + 1)
    scores = {name: round(v, 3) for name, v in
              evaluate(held, net, ells, lengths, list(range(len(held.traces))) * 20,
                       static=(4, min(2, len(ells) - 1))).items()}
    net.meta["held_out_tokens_per_s"] = scores
    low, high = (np.array([0.9, 0.9, 1.0, math.log10(args.low_rate)]),
                 np.array([0.9, 0.9, 1.0, math.log10(args.high_rate)]))
    net.meta["action_at_low_rate"] = net.actions[int(np.argmax(net.q_values(low)))].tolist()
    net.meta["action_at_high_rate"] = net.actions[int(np.argmax(net.q_values(high)))].tolist()
    net.save(args.out)
    print(json.dumps(net.meta, indent=1, ensure_ascii=False))
    print(f"hat-train-policy: saved {args.out}")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return cmd_record(args) if args.command == "record" else cmd_train(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"hat-train-policy: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
