"""The plot of a result: loss curves, each mode's gap to the BF16 experts, step times."""



def plot(result, path):
    """The loss curves of every mode and each FP8 mode's gap to the BF16 experts, from a result (the JSON)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (redraw later with --plot RESULT.json)")
        return
    losses = {}
    for row in result["rows"]:
        losses.setdefault(row["mode"], []).append(row["loss"])
    fig, (ax, gap, cost) = plt.subplots(1, 3, figsize=(18, 4.5))
    styles = {"unpadded": ("C0", "-", 2.5), "padded16": ("C1", "--", 1.5), "padded128": ("C3", ":", 1.5),
              "bf16": ("C2", "-", 1.0), "megatron": ("k", "-", 0.8), "te": ("C4", "-", 1.5)}
    for mode, curve in losses.items():
        color, ls, lw = styles.get(mode, ("k", "-", 1))
        ax.plot(curve, color=color, ls=ls, lw=lw, label=mode)
    ax.axhline(result["loss_floor"], color="k", lw=0.5, ls="--", label="the data's entropy")
    ep = result["config"].get("ep") or result["world_size"]
    cpu = result["config"].get("cpu")
    where = "on the CPU (reference backend)" if cpu else f"on Megatron-core, {result['world_size']} GPU(s), EP={ep}"
    ax.set(xlabel="step", ylabel="LM loss", ylim=(result["loss_floor"] - 0.2, None),
           title=f"MoE GPT {where}\nloss per step")
    ax.legend()
    ref = "megatron" if "megatron" in losses else "bf16" if "bf16" in losses else None
    if ref:
        for mode, curve in losses.items():
            if mode != ref:
                color, ls, lw = styles.get(mode, ("k", "-", 1))
                gap.plot([x - y for x, y in zip(curve, losses[ref])], color=color, ls=ls, lw=lw, label=mode)
        gap.axhline(0, color="k", lw=0.5)
        names = {"megatron": "Megatron's own BF16 experts", "bf16": "megatron_tma's BF16 experts"}
        gap.set(xlabel="step", ylabel=f"loss - {ref} loss",
                title=f"against {names[ref]}\n(same data, same initial weights)")
        gap.legend()
    modes = list(losses)
    ms = [result["summary"][m]["ms_per_step_median"] for m in modes]
    bars = cost.bar(modes, ms, color=[styles.get(m, ("k",))[0] for m in modes])
    # the experts' part of each step (--experts-share-steps), hatched at the bottom: what the rest of the step costs
    # each mode is the bar above it, so a ratio made outside the experts shows
    experts = [result["summary"][m].get("experts_ms_per_step") for m in modes]
    if any(e is not None for e in experts):
        from matplotlib.patches import Patch
        cost.bar(modes, [e or 0.0 for e in experts], fill=False, hatch="//", edgecolor="white", lw=0)
        cost.legend(handles=[Patch(facecolor="0.5", edgecolor="white", hatch="//", label="the experts' part")],
                    loc="upper right", fontsize=8)
    for bar, m in zip(bars, modes):
        peak, share = result["summary"][m].get("peak_mb"), result["summary"][m].get("experts_share_of_step")
        label = " ".join(([f"{peak / 1024:.1f} GB"] if peak is not None else [])
                         + ([f"experts {100 * share:.0f}%"] if share is not None else []))
        if label:
            cost.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                          ha="center", va="bottom", fontsize=8)
    impl = result["config"].get("transformer_impl") or "local"
    fp8 = result["config"].get("fp8_format")
    cost.set(ylabel="ms per step (median)",
             title="step time on the CPU" if cpu else
             f"step time ({impl} spec{', TE FP8 ' + str(result['config'].get('fp8_recipe')) if fp8 else ''})\n"
             "labels: peak memory, experts' share of the step (hatched)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # in-process runs (the tests) draw many
    print("wrote", path)
