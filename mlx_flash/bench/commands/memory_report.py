"""The report of python -m mlx_flash.bench memory: its table (printed) and its plot (tokens/s against the limit,
a line per engine/mode), from the rows a run summarized or from an earlier run's --json."""

import json
import os

from mlx_flash.errors import FlashError
from mlx_flash.convert.gguf_header import read_gguf_header

MB = 1e6


def fmt_cell(v, spec: str) -> str:
    return format("-", f">{spec.split('.')[0]}") if v is None else format(v, spec)


def print_table(rows: list[dict], bandwidth: float) -> None:
    head = (
        f"{'engine/mode':26} {'limit':>14} {'prefill':>8} {'TTFT':>7} {'decode':>7} {'peak cg':>8} {'VmHWM':>7} "
        f"{'major':>8} {'read':>7} {'MB read':>8} {'read':>6} {'disk-bound':>10}  outcome"
    )
    units = (
        f"{'':26} {'MB':>14} {'tok/s':>8} {'s':>7} {'tok/s':>7} {'MB':>8} {'MB':>7} "
        f"{'faults':>8} {'MB':>7} {'/token':>8} {'GB/s':>6} {'tok/s':>10}"
    )
    print(head + "\n" + units)
    for r in rows:
        limit = f"{r['limit'] / MB:.0f}"
        if "%" in r["limit_label"] or "capped" in r["limit_label"]:
            limit = f"{r['limit_label']}: {limit}"
        per_tok = None if r["decode_read_per_token"] is None else r["decode_read_per_token"] / MB
        vm = None if r["vmhwm"] is None else r["vmhwm"] / MB
        gbs = None if not r["decode_read_rate"] else r["decode_read_rate"] / 1e9
        print(
            f"{r['engine'] + ' ' + r['mode']:26} {limit:>14} {fmt_cell(r['prefill_tps'], '8.2f')} "
            f"{fmt_cell(r['ttft_s'], '7.2f')} {fmt_cell(r['decode_tps'], '7.3f')} {r['peak_cgroup'] / MB:8.0f} "
            f"{fmt_cell(vm, '7.0f')} {r['major_faults']:8.0f} {r['read_bytes'] / MB:7.0f} "
            f"{fmt_cell(per_tok, '8.1f')} {fmt_cell(gbs, '6.2f')} {fmt_cell(r['disk_bound_tps'], '10.3f')}  "
            f"{r['outcome']}"
        )
    fast = max((r["decode_read_rate"] or 0 for r in rows), default=0)
    if fast > bandwidth:
        print(
            f"  decode read {fast / 1e9:.2f} GB/s in a row, more than the probe's {bandwidth / 1e9:.2f} GB/s: this "
            "drive (or a cache beneath it) gave more than the probe saw, and the disk bound is low"
        )
    busy = [r for r in rows if r["others_cpu"] > 0.1]
    if busy:
        print(
            f"  other processes used more than 10% of the CPUs during {len(busy)} rows (up to "
            f"{max(r['others_cpu'] for r in busy):.0%}): those numbers are low"
        )
    for r in rows:
        if r.get("replay_tps") or r.get("expert_hit_rate") is not None:
            hit = "-" if r.get("expert_hit_rate") is None else f"{r['expert_hit_rate']:.1%}"
            line = f"  {r['engine']} {r['mode']} at {r['limit'] / MB:.0f} MB: expert hit rate {hit}"
            if r.get("replay_tps") and r["decode_tps"]:
                line += (
                    f"; its decode reads read again cold: {r['replay_tps']:.3f} tok/s, the row's decode "
                    f"{r['decode_tps'] / r['replay_tps']:.0%} of it"
                )
            print(line)
    for r in rows:
        if r["plan_line"] or r["refused"]:
            print(f"  {r['engine']} {r['mode']} at {r['limit'] / MB:.0f} MB: {r['refused'] or r['plan_line']}")


def model_title(model: str) -> str:
    """The GGUF's general.name (random-weight files say "synthetic"), else the file name."""
    if model.endswith(".gguf"):
        field = read_gguf_header(model).fields.get("general.name")
        if field is not None:
            return str(field.value)
    return os.path.basename(model.rstrip("/"))


def plot(rows: list[dict], title: str, bandwidth: float, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (dec, pre) = plt.subplots(1, 2, figsize=(12, 5.8))
    labels = list(dict.fromkeys(f"{r['engine']} {r['mode']}" for r in rows))
    for i, label in enumerate(labels):
        mine = sorted((r for r in rows if f"{r['engine']} {r['mode']}" == label), key=lambda r: r["limit"])
        color = f"C{i}"
        sparse = "sparse" in label  # approximate operating points: dotted, and no disk bound (a loose one)
        for ax, key in ((dec, "decode_tps"), (pre, "prefill_tps")):
            ok = [r for r in mine if r[key]]
            ax.plot(
                [r["limit"] / 1e9 for r in ok],
                [r[key] for r in ok],
                "s:" if sparse else "o-",
                color=color,
                label=label + (" (statistical activity)" if sparse else ""),
            )
            failed = [r for r in mine if not r[key]]
            if failed:  # OOM-killed, refused, timed out: a cross on the x axis
                ax.plot(
                    [r["limit"] / 1e9 for r in failed],
                    [0] * len(failed),
                    "x",
                    color=color,
                    markersize=10,
                    mew=2,
                    clip_on=False,
                    transform=ax.get_xaxis_transform(),
                )
        bound = [] if sparse else [r for r in mine if r["disk_bound_tps"]]
        if bound:
            dec.plot(
                [r["limit"] / 1e9 for r in bound],
                [r["disk_bound_tps"] for r in bound],
                "_--",
                color=color,
                ms=14,
                alpha=0.7,
                label=f"{label}: disk bound",
            )
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for ax, what in ((dec, "decode tokens/s"), (pre, "prefill tokens/s")):
        ax.set_xlabel("memory limit (GB)")
        ax.set_ylabel(what)
        ax.set_yscale("log")  # rates fall tenfold once the weights no longer fit
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(True, which="both", alpha=0.3)
    handles, names = dec.get_legend_handles_labels()  # below both panels: inside, it hides the lines
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=7, frameon=False)
    note = " (synthetic random weights)" if "synthetic" in title.lower() and "random" not in title.lower() else ""
    fig.suptitle(
        f"{title}{note}: cold page cache; x = OOM-killed/refused; disk read {bandwidth / 1e9:.2f} GB/s", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.05 + 0.025 * ((len(names) + 3) // 4), 1, 1))
    fig.savefig(png, dpi=110)
    plt.close(fig)


def replot(json_path: str, png: str | None) -> None:
    """The table and plot of an earlier run's JSON (--from-json)."""
    try:
        with open(json_path) as fh:
            run = json.load(fh)
    except (OSError, ValueError) as e:
        raise FlashError(f"{json_path}: not a bench_memory --json file ({e})") from None
    missing = [k for k in ("rows", "bandwidth", "title") if not isinstance(run, dict) or k not in run]
    if missing:
        raise FlashError(f"{json_path}: not a bench_memory --json file (no {', '.join(missing)})")
    print_table(run["rows"], run["bandwidth"])
    if png:
        plot(run["rows"], run["title"], run["bandwidth"], png)
