"""The figure of docs/performance.md (docs/bench_bandwidth.png): tokens/s relative to the
no-communication limit against link rate."""

from __future__ import annotations

from .netns import rate_bps

LABELS = {
    "ddp": "data parallel (DDP)",
    "local_sgd": "local SGD",
    "diloco": "DiLoCo-style",
    "co2": "CO2",
    "co2_stream": "CO2, streaming (F = tau)",
    "co2_node": "CO2, one worker per node",
}


def plot(lines: list[dict], path: str, *, ranks: int, model: str) -> None:
    """Throughput relative to the no-communication limit against link rate, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in lines if r["ranks"] == ranks and r["model"] == model and "rel_to_limit" in r]
    shaped = sorted({rate_bps(r["rate"]) / 1e6 for r in rows if r["rate"] != "unshaped"})
    unshaped_x = 10 * max(shaped, default=1000)  # drawn to the right of the fastest shaped link
    x_of = lambda rate: rate_bps(rate) / 1e6 if rate != "unshaped" else unshaped_x  # noqa: E731
    taus = sorted({r["tau"] for r in rows if r["tau"]})
    fig, axes = plt.subplots(1, len(taus), sharey=True, figsize=(5.5 * len(taus), 4.2), squeeze=False)
    for ax, tau in zip(axes[0], taus):
        for method, label in LABELS.items():
            pts = sorted(
                (x_of(r["rate"]), r["rel_to_limit"]) for r in rows if r["method"] == method and r["tau"] in (tau, None)
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(1.0, color="gray", linestyle="--", label="no communication (limit)")
        ax.set_xscale("log")
        ticks = [*shaped, unshaped_x]
        ax.set_xticks(ticks, [f"{x:g} Mbit/s" for x in shaped] + ["unshaped"])
        ax.minorticks_off()
        ax.set_title(f"{ranks} ranks, {model} model, tau {tau} (DDP: every step)")
        ax.set_xlabel("link rate (tc tbf, both directions)")
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tokens/s relative to the no-communication limit")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
