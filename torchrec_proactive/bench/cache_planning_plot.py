"""The figure of ``bench --cache-planning``: rows fetched per step, hit rate and step time of
each arm, and the per-table load factors, from the JSON report (``python -m ... report.json out.png``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict


def render(doc: Dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cp = doc.get("cache_planning", doc)
    arms = [a for a in ("uniform", "uniform_shared", "planned") if a in cp]
    labels = {"uniform": "uniform,\nper-table budgets", "uniform_shared": "uniform,\none shared cache",
              "planned": "planned,\nper-table budgets"}
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    colors = {"uniform": "#999999", "uniform_shared": "#bbbbbb", "planned": "#1f77b4"}
    for ax, key, title in ((axes[0], "rows_fetched_per_step", "rows fetched / step (lower is better)"),
                           (axes[1], "hit_rate", "hit rate"),
                           (axes[2], "step_ms", "median step ms (shared CPU)")):
        vals = [cp[a][key] for a in arms]
        ax.bar([labels[a] for a in arms], vals, color=[colors[a] for a in arms])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    tables = sorted(cp["load_factors"])
    x = range(len(tables))
    u = cp.get("uniform_load_factor")
    axes[3].bar([i - 0.2 for i in x], [u] * len(tables), width=0.4, color=colors["uniform"], label="uniform")
    axes[3].bar([i + 0.2 for i in x], [cp["load_factors"][t] for t in tables], width=0.4, color=colors["planned"],
                label="planned")
    info = cp.get("tables", {})
    axes[3].set_xticks(list(x), [f"{t}\n{info.get(t, {}).get('rows', '')} rows\nzipf {info.get(t, {}).get('zipf_alpha', '')}"
                                 for t in tables], fontsize=7)
    axes[3].set_title("load factor per table", fontsize=10)
    axes[3].legend(fontsize=8)
    fig.suptitle(f"cache planning at equal cache bytes ({cp['planned']['cache_bytes']} B; budget {cp['budget_bytes']} B, "
                 f"depth {cp['prefetch_depth']}; one store for the four tables; CPU, emulated link)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
