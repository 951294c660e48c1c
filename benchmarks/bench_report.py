"""The benchmark's report: the tables of step times and stage medians, and the plots (benchmarks/figures).
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import numpy as np
from bench_cases import CEILING_CASES

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).with_name("bench.py")  # the entry point every case process runs
for _path in (str(ROOT), str(ROOT / "examples")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def table(model_name: str, results: dict, global_batch: int, label: str = "") -> None:
    base = results["auto-1"]["step_s"]
    points = results["auto-1"]["points_per_sample"] * global_batch
    print(f"\n== {model_name}{label}: global batch {global_batch} samples, about {points:.0f} points per batch ==")
    print(f"{'case':<30}{'devices':>8}{'batch/dev':>10}{'ms/iter [min-max]':>24}{'speedup':>9}{'ideal':>7}{'points/s':>11}"
          f"{'CPU ms/iter':>13}{'peak RSS MB':>13}")
    ceilings = {name: r for name, r in results.items() if name in CEILING_CASES.values()}
    for name, r in results.items():
        if name in ceilings:
            continue
        devices = r["devices"]
        low, high = r.get("step_range", (r["step_s"], r["step_s"]))
        spread = f"{r['step_s'] * 1e3:.1f} [{low * 1e3:.1f}-{high * 1e3:.1f}]"
        print(f"{name:<30}{devices:>8}{global_batch / devices:>10.1f}{spread:>24}"
              f"{base / r['step_s']:>9.2f}{devices:>7}{points / r['step_s']:>11.0f}{r.get('cpu_s', 0.0) * 1e3:>13.1f}"
              f"{r.get('peak_rss_mb', 0.0):>13.0f}")
    for name, r in ceilings.items():
        reps = r.get("reps", [r])
        values = [x["ceiling"] for x in reps]
        print(f"{name}: plain Lightning {r['step_s'] * 1e3:.1f} ms a step, its network part "
              f"{statistics.median(x['network_s'] for x in reps) * 1e3:.1f} ms, in {r['devices']} bare threads "
              f"{statistics.median(x['bare_s'] for x in reps) * 1e3:.1f} ms: a thread-parallel strategy with no cost of its "
              f"own would reach {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}] (benchmarks/ceiling.py)")


#: Stages of a sparse_dp step as drawn and tabulated (``other``: the optimizer step and Lightning's loop); the main
#: thread's, so ``place`` only where a subclass's ``scatter`` places chunks there (else each replica's thread cuts and
#: places its chunk, ``scatter<i>``, inside its step: ``replica scatter max``).
STAGES = ["split", "place", "replicate", "state", "weigh", "apply", "gather", "log", "backward", "reduce", "other"]


def stage_breakdown(result: dict) -> dict[str, float]:
    """Median ms of each stage of one case; ``backward`` without ``reduce``; ``other`` = step - the rest."""
    st = {k: v * 1e3 for k, v in (result.get("stages") or {}).items()}
    if not st:
        return {}
    out = {n: st.get(n, 0.0) for n in STAGES[:-1]}
    out["backward"] = max(0.0, out["backward"] - out["reduce"])
    out["other"] = max(0.0, result["step_s"] * 1e3 - sum(out.values()))
    out["replica forward max"] = max((v for k, v in st.items() if re.fullmatch(r"replica\d+", k)), default=0.0)
    out["replica backward max"] = max((v for k, v in st.items() if re.fullmatch(r"backward\d+", k)), default=0.0)
    out["replica scatter max"] = max((v for k, v in st.items() if re.fullmatch(r"scatter\d+", k)), default=0.0)
    out["check in apply"] = st.get("check", 0.0)  # the main thread's check of the replicas, beside their scatter
    return out


def stage_table(results: dict) -> None:
    names = STAGES + ["replica forward max", "replica backward max", "replica scatter max", "check in apply"]
    print(f"\n{'stage medians (ms)':<30}" + "".join(f"{n.replace('replica ', 'r.'):>12}" for n in names))
    for case, r in results.items():
        st = stage_breakdown(r)
        if st:
            print(f"{case:<30}" + "".join(f"{st[n]:>12.2f}" for n in names))
    for case, r in results.items():
        layers = syncbn_layers(r)
        if layers:
            st = {k: v * 1e3 for k, v in r["stages"].items()}
            print(f"{case:<30} sync BN: {st['syncbn']:.2f} ms per step in {len(layers)} layers (forward + backward, mean "
                  f"over replicas), {st['syncbn_wait']:.2f} ms of it waiting for the slowest replica; per layer: "
                  + " ".join(f"{v:.2f}" for v in layers))


def syncbn_layers(result: dict) -> list[float]:
    """Median ms of each synchronized batch-norm layer of one case (``syncbn<j>``), layer order; empty without."""
    st = result.get("stages") or {}
    found = sorted(int(k[6:]) for k in st if re.fullmatch(r"syncbn\d+", k))
    return [st[f"syncbn{j}"] * 1e3 for j in found]


#: ME's documentation, MinkUNet on 4 Titan XP GPUs: average speedup at 2 / 3 / 4 GPUs (the seed's table).
ME_GPU_SPEEDUP = {1: 1.0, 2: 1.90, 3: 2.60, 4: 2.60}


def _speedup_lines(results: dict) -> dict[str, tuple[list[int], list[float]]]:
    base = results["auto-1"]["step_s"]
    one = results.get("sparse_dp-1", results["auto-1"])["step_s"]
    lines = {
        "sparse_dp": ([1] + [d for d in (2, 3) if f"sparse_dp-{d}" in results],
                      [base / one] + [base / results[f"sparse_dp-{d}"]["step_s"] for d in (2, 3) if f"sparse_dp-{d}" in results]),
        "sparse_dp, sync BN": ([1] + [d for d in (2, 3) if f"sparse_dp-{d} syncBN" in results],
                               [base / one] + [base / results[f"sparse_dp-{d} syncBN"]["step_s"] for d in (2, 3)
                                               if f"sparse_dp-{d} syncBN" in results]),
    }
    if "ddp-2 (gloo)" in results:  # not every model and mode runs it (or it failed in every repetition)
        lines["DDP (gloo)"] = ([1, 2], [1.0, base / results["ddp-2 (gloo)"]["step_s"]])
    return lines


def plot(runs: dict, out_dir: Path) -> list[Path]:
    """``speedup.png`` (speedup against devices) and ``stages.png`` (stacked stage times) from ``runs``.

    ``runs[(model, mode)]`` is a results dict of :func:`run_model`; ``mode`` is ``"default"`` or ``"1 thread"``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    models = sorted({m for m, _ in runs}, key=["segmentation", "digits"].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.6), squeeze=False)
    colors = {"sparse_dp": "tab:blue", "sparse_dp, sync BN": "tab:orange", "DDP (gloo)": "tab:green"}
    for ax, model in zip(axes[0], models):
        for mode, style in (("default", "-"), ("1 thread", "--")):
            if (model, mode) not in runs:
                continue
            for name, (xs, ys) in _speedup_lines(runs[(model, mode)]).items():
                ax.plot(xs, ys, style, marker="o", color=colors[name], label=f"{name} ({mode})")
        ax.plot([1, 4], [1, 4], ":", color="gray", label="ideal")
        ax.plot(list(ME_GPU_SPEEDUP), list(ME_GPU_SPEEDUP.values()), "-.", marker="s", color="black",
                label="ME docs, MinkUNet on GPUs")
        ax.set(title=f"{model}: speedup over plain Lightning on one device", xlabel="devices (CPU replicas / processes)",
               ylabel="speedup", xticks=[1, 2, 3, 4])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    speedup = out_dir / "speedup.png"
    fig.savefig(speedup, dpi=110, bbox_inches="tight")
    plt.close(fig)

    bars = [(f"{model} {case} ({mode})", stage_breakdown(r)) for (model, mode), results in runs.items()
            for case, r in results.items() if model == "segmentation" and stage_breakdown(r)]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(bars) + 2.0))
    left = np.zeros(len(bars))
    cmap = plt.get_cmap("tab10")
    for i, stage in enumerate(STAGES):
        widths = np.array([b[stage] for _, b in bars])
        ax.barh([name for name, _ in bars], widths, left=left, color=cmap(i), label=stage)
        left += widths
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (medians; apply = the replicas' forward, backward = their backward passes)",
           title="segmentation: where a sparse_dp step's time goes")
    ax.legend(ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.4 / max(len(bars), 1)), frameon=False)
    fig.tight_layout()
    stages = out_dir / "stages.png"
    fig.savefig(stages, dpi=110, bbox_inches="tight")  # "tight": the legend below the axes and the label stay in
    plt.close(fig)
    return [speedup, stages]
