"""`hat-calibrate`: measure how the draft's uncertainty predicts rejection, on real prompts kept apart from evaluation.

Both models run in this process, on the path an HLM generation takes: the draft proposes a few tokens, the target
verifies them exactly (hat_split.math.verify through `TargetDriver`, on the cloud's own `TargetState`), the accepted
text goes on. For every examined draft token (accepted ones and the first rejected one of each round) it records the
uncertainty u (temperature perturbation of the draft's logits, U-HLM eq. 8-9), the draft probability x_d and the target
probability y_d, and adds the token's tail-to-distortion ratios for CU-HLM's offline k*. hat_split.math.calibration
turns the records into the rejection line, Δ, the two thresholds, the risk and its bound, and k*; the result is saved
as JSON for `hat-edge --calibration`, the raw records as .npz, and a plot of u against β with the fit (the papers' Fig.
2 / 5) as PNG. The JSON carries its provenance (commit, command, machine: hat_split.files.provenance) under
extra.provenance, the one free field of the calibration format.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from edge_runtime.drafter import Drafter
from hat_split.files.figures import NO_MATPLOTLIB, pyplot
from hat_split.files.provenance import provenance
from hat_split.math import calibration as C
from hat_split.math.calibration import OfflineKAccumulator
from hat_split.math.rng import session_rng
from hat_split.math.sampling import SamplingParams
from hat_split.math.uncertainty import PerturbationConfig, perturbation_uncertainty
from hat_split.models.chat import encode
from hat_split.models.lm import CausalLM
from hat_split.models.loading import load_pair
from hat_split.models.target import TargetDriver
from hat_split.files import strict_json
from hat_split.prompt_sets import calibration_prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hat-calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=24, help="calibration prompts (disjoint from evaluation prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of both models")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--draft-len", type=int, default=4, help="drafts per verification round")
    ap.add_argument("--perturb-samples", type=int, default=20, help="M temperatures")
    ap.add_argument("--theta-max", type=float, default=2.0, help="temperatures ~ U[0, θmax]")
    ap.add_argument("--k-theta", type=float, default=0.1, help="tolerance θ of the offline k* (CU-HLM eq. 21)")
    ap.add_argument("--risk-budget", type=float, default=0.02,
                    help="the risk-budget rule: largest threshold whose skipped tokens add <= this rejection per token")
    ap.add_argument("--k-max", type=int, default=8192, help="largest k considered for k*")
    ap.add_argument("--weight-quant", default="int8", choices=["none", "int8"], help="the draft's weights")
    ap.add_argument("--target-dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/calibration.json", help="calibration file (.npz records and .png beside)")
    return ap


def _check(args) -> None:
    if args.prompts < 3 or args.max_new_tokens < 1 or args.draft_len < 1 or args.k_max < 1 or args.risk_budget < 0:
        raise ValueError("--prompts must be >= 3, --max-new-tokens, --draft-len and --k-max >= 1, --risk-budget >= 0")
    if not args.temperature > 0:
        raise ValueError("--temperature must be > 0: rejection probabilities are about sampled drafts")


def record(args):
    """Load the pair and run it on the calibration prompts; returns (u, x_d, y_d, accumulator, seconds)."""

    prompts = calibration_prompts(args.prompts)
    draft, target, eos = load_pair(args.draft, args.target, args.weight_quant, args.target_dtype)
    t0 = time.perf_counter()
    u, x_d, y_d, acc = record_pair(
        CausalLM(draft.model), CausalLM(target.model), [encode(draft.tokenizer, p.text, p.chat) for p in prompts],
        SamplingParams(args.temperature, 0, args.top_p), PerturbationConfig(args.perturb_samples, args.theta_max),
        args.max_new_tokens, args.draft_len, args.k_max, eos, args.seed, [p.source for p in prompts])
    return u, x_d, y_d, acc, time.perf_counter() - t0


def record_pair(d_lm, t_lm, prompts, params, pert, max_new_tokens, draft_len, k_max, eos=frozenset(), seed=0,
                names=None):
    """Records of every examined draft token over `prompts` (token id lists): u, x_d, y_d `# [N]` and the k* sums."""

    acc = OfflineKAccumulator(k_max)
    us, xs, ys = [], [], []
    for i, ids in enumerate(prompts):
        rng, u_rng = session_rng(seed * 1000 + i, "device"), session_rng(seed * 1000 + i, "uncertainty")
        drafter = Drafter(d_lm, params)
        session = TargetDriver(t_lm, i, "sd", params, seed * 1000 + i, list(ids))
        session.prefill()
        drafter.start(ids)
        n_out = 0
        while n_out < max_new_tokens:
            drafts, _ = drafter.draft(max(1, min(draft_len, max_new_tokens - n_out - 1)), rng)
            q = drafter.last_q  # per draft `# [vocab]`: what it was sampled from
            u = perturbation_uncertainty(drafter.last_logits, np.asarray(drafts), pert, u_rng)  # [L]
            n, token = session.verify([], drafts, np.stack(q))
            p = session.last_p  # [L + 1, vocab]
            for j in range(min(n + 1, len(drafts))):  # accepted drafts and the first rejected one
                us.append(float(u[j]))
                xs.append(float(q[j][drafts[j]]))
                ys.append(float(p[j, drafts[j]]))
                acc.add(q[j], p[j])
            committed = drafts[:n] + [token]
            drafter.commit(committed, n)
            n_out += len(committed)
            if any(t in eos for t in committed):
                break
        name = names[i] if names else f"#{i}"
        print(f"  prompt {i + 1}/{len(prompts)} ({name}): {n_out} tokens, {len(us)} records so far", flush=True)
    return np.array(us), np.array(xs), np.array(ys), acc


def plot(path: str, u: np.ndarray, beta: np.ndarray, cal) -> str:
    """u vs β with the fitted line and both thresholds, and the density of u. Returns a note when it cannot plot."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(10, 4))
    ax.scatter(u, beta, s=6, alpha=0.3, label="tokens")
    grid = np.linspace(0, 1, 50)
    ax.plot(grid, np.clip(cal.fit.a * grid + cal.fit.b, 0, 1), "r-",
            label=f"β = {cal.fit.a:.3f}·u + {cal.fit.b:.3f} (R² {cal.fit.r2:.2f})")
    for x, name in ((cal.u_risk_averse, "risk-averse"), (cal.u_risk_prone, "risk-prone"),
                    (cal.u_risk_budget, f"risk {cal.risk_budget:g}")):
        ax.axvline(x, ls="--", c="gray")
        ax.text(x, 0.95, name, rotation=90, va="top", fontsize=8)
    ax.set_xlabel("uncertainty u")
    ax.set_ylabel("rejection probability β")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=8)
    hx.hist(u, bins=50, range=(0, 1), density=True)
    hx.set_xlabel("uncertainty u")
    hx.set_ylabel("density")
    fig.suptitle(f"{cal.draft} → {cal.target}, {cal.n_tokens} tokens, T = {cal.temperature}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ""


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        print(f"hat-calibrate: {exc}", file=sys.stderr)
        return 2

    try:
        u, x_d, y_d, acc, seconds = record(args)
    except (ValueError, RuntimeError) as exc:  # a mismatched pair, a missing model or prompt package
        print(f"hat-calibrate: {exc}", file=sys.stderr)
        return 2
    try:
        cal = C.calibrate(u, x_d, y_d, acc, args.k_theta, args.risk_budget, draft=args.draft, target=args.target,
                          temperature=args.temperature, perturb_samples=args.perturb_samples,
                          theta_max=args.theta_max,
                          extra={"seconds": seconds, "k_tokens": acc.count, "provenance": provenance()})
    except ValueError as exc:
        print(f"hat-calibrate: {exc}", file=sys.stderr)
        return 1
    base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    C.save(args.out, cal)
    beta = C.rejection_probability(x_d, y_d)
    np.savez_compressed(base + ".npz", u=u, x_d=x_d, y_d=y_d, beta=beta, mean_u_k=acc.mean())
    note = plot(base + ".png", u, beta, cal)
    print(strict_json.dumps(cal.to_json(), indent=1))
    print(f"hat-calibrate: {cal.n_tokens} tokens in {seconds:.0f} s; β = {cal.fit.a:.3f}·u + {cal.fit.b:.3f} "
          f"(MSE {cal.fit.mse:.4f}, R² {cal.fit.r2:.3f}, corr {cal.fit.corr:.3f}); Δ = {cal.delta:.3f}; "
          f"u_th risk-averse {cal.u_risk_averse:.3f}, risk-prone {cal.u_risk_prone:.3f}, "
          f"risk-budget {cal.u_risk_budget:.3f} (R <= {cal.risk_budget}); "
          f"R measured {cal.risk_measured:.2e}, model {cal.risk_model:.2e} <= bound {cal.risk_bound:.2e}; "
          f"k* = {cal.k_star} at θ = {cal.k_theta}")
    print(f"hat-calibrate: saved {args.out}, {base}.npz" + (f", {base}.png" if not note else f" ({note})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
