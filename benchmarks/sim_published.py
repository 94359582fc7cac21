"""The published DeepSeek-V3 deployments against the analytic model (`sim.deployments`):
calibrate the one efficiency scale on DeepSeek's profile, then predict SGLang on 96 H100s and
vLLM on GB200 with it, and SGLang's EPLB speed-ups with the stated expert skew.

    .venv/bin/python benchmarks/sim_published.py --out benchmarks/results/sim_published.json

Split: calibration = DeepSeek profile-data (prefill EP32, decode EP128; balanced routing);
held out = everything else. The DeepSeek day-6 averages are `benchmarks/sim_deepseek_day.py`.
Pure Python, a few seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.sim.deployments import BASE_ATTN_MFU, BASE_MFU, calibrate, predict  # noqa: E402
from deepinfer.sim import published_deployments as published  # noqa: E402

DEFAULT_SKEW = 0.5  # the Zipf exponent sim_deepseek.py's EPLB runs state


def report(skew: float = DEFAULT_SKEW) -> dict:
    """Calibration, predictions and EPLB speed-ups (what the unit test checks too)."""
    calibration = calibrate(published.CALIBRATION)
    scale = calibration["efficiency_scale"]
    rows = []
    for split, deps in (("calibration", published.CALIBRATION),
                        ("held out", published.sglang(skew) + published.vllm(skew))):
        for dep in deps:
            row = predict(dep, scale).to_dict()
            rows.append({**row, "split": split, "source": dep.source, "per": dep.per,
                         "settings": dep.settings})
    eplb = {}
    for phase, (with_eplb, without, speedup) in published.eplb_pairs(skew).items():
        a, b = predict(with_eplb, scale), predict(without, scale)
        eplb[phase] = {"published_speedup": speedup,
                       "predicted_speedup": a.predicted_tok_s / b.predicted_tok_s,
                       "imbalance_with": a.imbalance, "imbalance_without": b.imbalance}
    return {"calibration": calibration, "base_efficiency": {"mfu": BASE_MFU,
                                                           "attn_mfu": BASE_ATTN_MFU},
            "skew": skew, "deployments": rows, "eplb_speedup": eplb}


def print_report(out: dict) -> None:
    cal = out["calibration"]
    print(f"efficiency scale {cal['efficiency_scale']:.3f} (per calibration deployment: "
          + ", ".join(f"{k} {v:.3f}" for k, v in cal["per_deployment"].items())
          + f"): GEMMs at {out['base_efficiency']['mfu'] / cal['efficiency_scale']:.3f} and "
          f"attention at {out['base_efficiency']['attn_mfu'] / cal['efficiency_scale']:.3f} "
          "of peak")
    print(f"{'split':12s} {'deployment':32s} {'published':>10s} {'predicted':>10s} "
          f"{'error':>7s} {'step ms':>8s} {'imbal.':>6s} {'overlap':>7s}")
    for r in out["deployments"]:
        print(f"{r['split']:12s} {r['name']:32s} {r['published_tok_s']:10,.0f} "
              f"{r['predicted_tok_s']:10,.0f} {100 * r['error']:+6.1f}% {r['step_ms']:8.1f} "
              f"{r['imbalance']:6.3f} {r['overlap']:7.2f}  (tok/s per {r['per']})")
    for phase, e in out["eplb_speedup"].items():
        print(f"EPLB speed-up, {phase} (Zipf {out['skew']}): predicted "
              f"{e['predicted_speedup']:.2f}x, published {e['published_speedup']:.2f}x "
              f"(imbalance {e['imbalance_without']:.2f} -> {e['imbalance_with']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skew", type=float, default=DEFAULT_SKEW,
                        help="Zipf exponent of the expert loads (default %(default)s)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_published.json"))
    args = parser.parse_args()
    if args.skew < 0:
        parser.exit(2, "sim_published: --skew must be >= 0\n")
    out = report(args.skew)
    print_report(out)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
