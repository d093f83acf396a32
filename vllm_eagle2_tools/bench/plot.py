"""The benchmark's PNG plots (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_eagle2_tools.bench.records import CHAIN_MODES


def plot(results: dict[str, Any], out_json: Path) -> list[str]:
    """PNG plots next to the JSON: tau and tokens/s by mode; tokens/s against batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    bs0 = results["batch_sizes"][0]
    rows = [r for r in results["main_rows"] if r["batch_size"] == bs0 and not r.get("error")]
    if rows:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        labels = [r["label"] for r in rows]
        ax1.bar(labels, [r["tau"] or 1.0 for r in rows], color="tab:blue")
        ax1.set_ylabel("mean acceptance length tau")
        ax2.bar(labels, [r["tokens_per_s"] or 0 for r in rows], color="tab:green")
        ax2.set_ylabel("output tokens/s")
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=40)
            for lab in ax.get_xticklabels():
                lab.set_ha("right")
        fig.suptitle(f"{results['setup']['description']} - batch {bs0}", fontsize=9)
        fig.tight_layout()
        path = out_json.with_suffix(".modes.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    if len(results["batch_sizes"]) > 1:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        series: dict[str, list[dict[str, Any]]] = {}
        for r in results["main_rows"]:
            if r["tokens_per_s"]:
                name = f"vLLM {r['mode']} (best k)" if r["mode"] in CHAIN_MODES else r["label"]
                series.setdefault(name, []).append(r)
        for name, rows in series.items():
            rows.sort(key=lambda r: r["batch_size"])
            x = [r["batch_size"] for r in rows]
            (line,) = ax1.plot(x, [r["tokens_per_s"] for r in rows], marker="o", label=name)
            speedup = [r.get("speedup") or 0.0 for r in rows]
            # the range over --rounds (none with one round)
            spread = [r.get("speedup_rounds") or [s] for r, s in zip(rows, speedup)]
            low = [s - min(v) for s, v in zip(speedup, spread)]
            high = [max(v) - s for s, v in zip(speedup, spread)]
            ax2.errorbar(x, speedup, yerr=[low, high], marker="o", capsize=3, color=line.get_color())
        ax2.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax2.set_ylabel("speed-up over no speculation")
        ax1.set_ylabel("output tokens/s")
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size (max_num_seqs)")
        ax1.legend(fontsize=8)
        fig.suptitle(results["setup"]["description"], fontsize=9)
        fig.tight_layout()
        path = out_json.with_suffix(".batch.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
