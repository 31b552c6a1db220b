"""Outputs of ``torchtsp bench``: results.json, a markdown table and PNG plots (torch-free).

Plots use matplotlib's object-oriented API on the Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..recompute import FULL, NONE, SELECTIVE, recompute_policy
from ..schemes import SCHEMES
from .infer import ratio_text, tpot_text

MiB = 2**20
SCHEME_ORDER = tuple(SCHEMES)  # the registry's order
# Each scheme's color and marker are its registry entry's; distinct markers keep schemes with equal values (tp and
# torch_tp have the same memory) visible.
COLORS = {s.name: s.color for s in SCHEMES.values()}
MARKERS = {s.name: s.marker for s in SCHEMES.values()}
# Each series also has its own line style, by its place in the registry's order; hollow markers shrink along that
# order so that coinciding ones nest, and each series is shifted by its own small fraction of an octave along S
# (DODGE), so none hides another.
LINESTYLES = ("-", "--", "-.", (0, (1, 1)), (0, (5, 1, 1, 1, 1, 1)), (0, (3, 2)))
DODGE = 0.04  # octaves between neighbouring series along a log2 S axis

# The report's words for each recompute policy (a run recorded before the policies stored a bool).
RECOMPUTE_WORDS = {NONE: "saved by every scheme", FULL: "every scheme recomputes each layer in backward",
                   SELECTIVE: "selective recompute (the MLP's elementwise hidden state recomputed in backward)"}


def _style(scheme: str, line: bool = True) -> dict:
    size = 9.0 - 0.8 * min(_rank(scheme), len(SCHEME_ORDER))
    style = LINESTYLES[_rank(scheme) % len(LINESTYLES)] if line else "none"
    return dict(marker=MARKERS.get(scheme, "o"), linestyle=style,
                color=COLORS.get(scheme), markersize=size, markerfacecolor="none", markeredgewidth=1.4)


def _dodged(xs, index: int, count: int) -> list[float]:
    """``xs`` shifted by the series' own fraction of an octave: series ``index`` of ``count`` on one axis."""
    shift = 2 ** (DODGE * (index - (count - 1) / 2))
    return [x * shift for x in xs]


def series_label(scheme: str, mesh: str | None) -> str:
    """A series' name: the scheme, or the layout it really ran when an axis of a scheme of several axes has
    size 1 (tp_sp on 2 ranks is tp=2 x sp=1: plain TP2)."""
    axes = SCHEMES[scheme].axes if scheme in SCHEMES else ()
    sizes = dict(part.split("=") for part in (mesh or "").split(" x ") if "=" in part)
    idle = [a for a in axes if a not in sizes]
    if len(axes) < 2 or not idle or len(idle) == len(axes):
        return scheme
    live = "x".join(f"{a.upper()}{sizes[a]}" for a in axes if a in sizes)
    return f"{live} ({scheme}, {', '.join(f'{a}=1' for a in idle)})"


def _rank(scheme: str) -> int:
    return SCHEME_ORDER.index(scheme) if scheme in SCHEME_ORDER else len(SCHEME_ORDER)


def _order(schemes) -> list[str]:
    return sorted(dict.fromkeys(schemes), key=_rank)


def _mib(b) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def _int(b) -> str:
    return "-" if b is None else f"{b:,}"


def _match(m) -> str:
    return "-" if m is None else ("yes" if m else "**NO**")


def _share(f) -> str:
    return "-" if f is None else f"{100 * f:.0f}%"


def _pct(p) -> str:
    return "-" if p is None else f"{p:+.1f}%"


def _layers(m: dict) -> str:
    """"6 layers" or, for a hybrid model, "6 layers (5 sliding, window 512 : 1 full)"."""
    types = m.get("layer_types") or []
    sliding = sum(t == "sliding_attention" for t in types)
    if not sliding:
        return f"{m['n_layers']} layers"
    return f"{m['n_layers']} layers ({sliding} sliding, window {m['sliding_window']} : {m['n_layers'] - sliding} full)"


def _model_line(meta: dict) -> str:
    m = meta["model"]
    return (f"model dim {m['dim']}, {_layers(m)}, {m['n_heads']} heads / {m['n_kv_heads']} KV heads, "
            f"ffn {m['ffn_dim']}, vocab {m['vocab_size']}{', tied' if m.get('tie_embeddings') else ''}; "
            f"global batch {meta['batch']}; {meta['world']} ranks ({meta['launcher']}, {meta['backend']}, "
            f"{meta['device']}, {meta['dtype']})")


# ---------------------------------------------------------------- the sweep


def lowest_memory(cells: list[dict]) -> dict[int, str]:
    """The scheme with the lowest measured per-rank peak at each sequence length."""
    best: dict[int, tuple[int, str]] = {}
    for c in cells:
        if c["status"] == "ok" and (c["seq_len"] not in best or c["peak_bytes"] < best[c["seq_len"]][0]):
            best[c["seq_len"]] = (c["peak_bytes"], c["scheme"])
    return {S: s for S, (_, s) in sorted(best.items())}


def sweep_markdown(result: dict) -> str:
    meta, cells = result["meta"], result["cells"]
    lines = [
        "# torchtsp bench",
        "",
        _model_line(meta) + ".",
        f"Step = forward + backward + AdamW; median of {meta['steps']} timed steps after {meta['warmup']} warm-up "
        f"step(s) (slowest rank per step); peak = live tensor bytes of one whole step with optimizer state, "
        f"max over ranks; bytes = received per rank in one forward, counted by the comm layer; "
        f"exposed comm = share of the timed steps a rank spent blocked on transfers (largest over ranks); "
        f"tp and torch_tp sequence parallel: {'on' if meta['sequence_parallel'] else 'off'}; activations: "
        f"{RECOMPUTE_WORDS[recompute_policy(meta.get('recompute'))]}. "
        f"Run took {meta['elapsed_s']:.0f} s ({meta['date']}, torch {meta['torch']}, {meta['cpu_count']} CPU cores).",
        "",
        "| scheme | mesh | S | peak MiB | predicted MiB | error | step ms | tokens/s | exposed comm | fwd bytes "
        "| predicted fwd bytes | match | step bytes match |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for S in sorted({c["seq_len"] for c in cells}):
        for c in sorted((c for c in cells if c["seq_len"] == S), key=lambda c: _rank(c["scheme"])):
            if c["status"] != "ok":
                lines.append(f"| {c['scheme']} | {c['mesh']} | {S} | {c['status']} |  |  |  |  |  |  |  |  |  |")
                continue
            lines.append(
                f"| {c['scheme']} | {c['mesh']} | {S} | {_mib(c['peak_bytes'])} | {_mib(c['predicted_peak_bytes'])} "
                f"| {_pct(c['peak_error_pct'])} | {c['median_step_s'] * 1000:.0f} | {c['tokens_per_s']:,.0f} "
                f"| {_share(c.get('exposed_comm_fraction'))} "
                f"| {_int(c['forward_bytes'])} | {_int(c['predicted_forward_bytes'])} | {_match(c['bytes_match'])} "
                f"| {_match(c['step_bytes_match'])} |")
    lines += ["", "Lowest measured per-rank peak: "
              + ", ".join(f"S={S}: {s}" for S, s in lowest_memory(cells).items()) + "."]
    errors = {}
    for c in cells:
        if c["status"] == "ok" and c.get("peak_error_pct") is not None:
            errors.setdefault(c["scheme"], []).append(abs(c["peak_error_pct"]))
    if errors:
        lines.append("Largest |memory prediction error| per scheme: "
                     + ", ".join(f"{s} {max(errors[s]):.1f}%" for s in _order(errors)) + ".")
    routed = [c for c in cells if c["status"] == "ok" and c.get("routed_vs_expected")]
    if routed:
        lines.append("Expert all-to-all bytes depend on routing: the byte columns leave them out, and per step they "
                     "were (measured / expected under uniform routing) "
                     + ", ".join(f"{c['scheme']} S={c['seq_len']}: {c['routed_vs_expected']:.3f}" for c in routed)
                     + ".")
    ratio = result.get("tp_vs_torch_tp")
    if ratio:
        if ratio["ratio_by_seq_len"]:
            per = ", ".join(f"S={S}: {r:.2f}" for S, r in ratio["ratio_by_seq_len"].items())
            lines.append(f"tp / torch_tp median step time, timed interleaved on the same ranks: {per} "
                         f"(worst {ratio['max_ratio']:.2f}, summed over S {ratio['total_ratio']:.2f}).")
        per = ", ".join(f"S={S}: {r:.2f}" for S, r in ratio["cell_ratio_by_seq_len"].items())
        lines.append(f"The same ratio from the table's cells (timed apart, more exposed to background load): {per}.")
    return "\n".join(lines) + "\n"


def _figure(width=6.4, height=4.4, ncols=1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig, (fig.add_subplot() if ncols == 1 else fig.subplots(1, ncols))


def _by_scheme(cells, key):
    series: dict[str, list[tuple[int, float]]] = {}
    for c in cells:
        if c["status"] == "ok" and c.get(key) is not None:
            series.setdefault(c["scheme"], []).append((c["seq_len"], c[key]))
    return {s: sorted(series[s]) for s in _order(series)}


def _meshes(cells) -> dict[str, str]:
    return {c["scheme"]: c.get("mesh") for c in cells if c.get("status", "ok") == "ok"}


def plain_number(value: float, _pos=None) -> str:
    """A tick label as people write numbers (90, 1.5, 12,000), never 9×10¹."""
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _nice_ticks(lo: float, hi: float) -> list[float]:
    """Three to eight round values (1-2-5 per decade, finer when the range is narrow) within [lo, hi]; for a
    range too narrow for that, the round values around it."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9), tuple(m / 10 for m in range(10, 100))):
        ticks = [round(m * 10.0**d, 12) for d in range(first - 1, last + 1) for m in mantissas]
        inside = [t for t in ticks if lo <= t <= hi]
        if len(inside) >= 3:
            return inside[::-(-len(inside) // 8)]
    below, above = [t for t in ticks if t < lo], [t for t in ticks if t > hi]
    return [below[-1], *inside, *above[:3 - len(inside) - 1]]


def _log_axis(ax, values) -> None:
    """A log y axis with explicit round ticks (matplotlib would label a narrow range once, or not at all) and
    plain number labels."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    values = [v for v in values if v and v > 0]
    ax.set_yscale("log")
    if not values:
        return
    ticks = _nice_ticks(min(values), max(values))
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(min(ticks[0], min(values)) / 1.15, max(ticks[-1], max(values)) * 1.15)


def _seq_axis(ax, seq_lens):
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(seq_lens)))
    ax.xaxis.set_major_formatter(FuncFormatter(plain_number))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length S (series shifted a little apart)")
    ax.grid(True, which="both", alpha=0.3)


def memory_figure(result: dict):
    cells, meta = result["cells"], result["meta"]
    fig, ax = _figure()
    measured, predicted = _by_scheme(cells, "peak_bytes"), _by_scheme(cells, "predicted_peak_bytes")
    order, meshes = _order([*measured, *predicted]), _meshes(cells)
    for s, pts in measured.items():
        ax.plot(_dodged([p[0] for p in pts], order.index(s), len(order)), [p[1] / MiB for p in pts], **_style(s),
                label=series_label(s, meshes.get(s)))
    for s, pts in predicted.items():
        ax.plot(_dodged([p[0] for p in pts], order.index(s), len(order)), [p[1] / MiB for p in pts],
                linestyle=(0, (1, 2)), lw=1, color=COLORS.get(s), alpha=0.6,
                label=f"{series_label(s, meshes.get(s))} predicted")
    _log_axis(ax, [p[1] / MiB for pts in (*measured.values(), *predicted.values()) for p in pts])
    ax.set_ylabel("per-rank peak live memory (MiB)")
    _seq_axis(ax, {c["seq_len"] for c in cells})
    ax.set_title(f"Peak memory per rank, {meta['world']} ranks, B={meta['batch']}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_memory(result: dict, path: Path) -> Path:
    memory_figure(result).savefig(path)
    return path


def throughput_figure(result: dict):
    cells, meta = result["cells"], result["meta"]
    fig, ax = _figure()
    series, meshes = _by_scheme(cells, "tokens_per_s"), _meshes(cells)
    for i, (s, pts) in enumerate(series.items()):
        ax.plot(_dodged([p[0] for p in pts], i, len(series)), [p[1] for p in pts], **_style(s),
                label=series_label(s, meshes.get(s)))
    _log_axis(ax, [p[1] for pts in series.values() for p in pts])
    ax.set_ylabel("tokens/s (forward + backward + AdamW)")
    _seq_axis(ax, {c["seq_len"] for c in cells})
    ax.set_title(f"Training throughput, {meta['world']} ranks ({meta['device']}), B={meta['batch']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_throughput(result: dict, path: Path) -> Path:
    throughput_figure(result).savefig(path)
    return path


def bytes_figure(result: dict):
    """Bytes received per rank vs S: predicted (dashed lines) and counted (markers), forward and whole step.
    Cells whose count differs from the prediction are marked with a black cross."""
    cells = [c for c in result["cells"] if c["status"] == "ok" and c.get("forward_bytes") is not None]
    fig, axes = _figure(10.0, 4.4, ncols=2)
    tiny = sorted({c["scheme"] for c in cells if c["predicted_forward_bytes"] < 1024})
    order, meshes = _order(c["scheme"] for c in cells), _meshes(cells)
    for ax, (key, pred, match, title) in zip(axes, (
            ("forward_bytes", "predicted_forward_bytes", "bytes_match", "one forward"),
            ("step_bytes", "predicted_step_bytes", "step_bytes_match", "one whole step"))):
        shown = []
        for i, s in enumerate(order):
            pts = sorted((c["seq_len"], c[pred], c[key], c[match]) for c in cells if c["scheme"] == s
                         and c[pred] >= 1024)
            if not pts:
                continue
            xs = _dodged([p[0] for p in pts], i, len(order))
            ax.plot(xs, [p[1] / MiB for p in pts], "--", color=COLORS.get(s), alpha=0.7)
            ax.plot(xs, [p[2] / MiB for p in pts], **_style(s, line=False), label=series_label(s, meshes.get(s)))
            shown += [v / MiB for p in pts for v in (p[1], p[2])]
            bad = [(x, p) for x, p in zip(xs, pts) if not p[3]]
            if bad:
                ax.plot([x for x, _ in bad], [p[2] / MiB for _, p in bad], "kx", ms=12, mew=2)
        ok = sum(bool(c[match]) for c in cells)
        _log_axis(ax, shown)
        ax.set_ylabel("MiB received per rank")
        _seq_axis(ax, {c["seq_len"] for c in cells})
        ax.set_title(f"{title}: {ok}/{len(cells)} cells exactly as predicted", fontsize=9)
        ax.legend(fontsize=7)
    if tiny:
        axes[0].text(0.02, 0.02, f"not shown (< 1 KiB): {', '.join(tiny)}", transform=axes[0].transAxes, fontsize=7)
    fig.suptitle("Communication counted by the comm layer (markers) vs predicted (dashed)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bytes(result: dict, path: Path) -> Path:
    bytes_figure(result).savefig(path)
    return path


def write_sweep(result: dict, out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and (``plots``) memory_vs_seq.png, throughput_vs_seq.png,
    bytes_pred_vs_meas.png in ``out``; returns the paths written, JSON and markdown first."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "results.json", out / "results.md"]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    files[1].write_text(sweep_markdown(result))
    if plots:
        files += [plot_memory(result, out / "memory_vs_seq.png"),
                  plot_throughput(result, out / "throughput_vs_seq.png"),
                  plot_bytes(result, out / "bytes_pred_vs_meas.png")]
    return files


# ---------------------------------------------------------------- --max-seq-under


def max_seq_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [
        f"# torchtsp bench --max-seq-under {result['budget_gib']:g}",
        "",
        _model_line(meta) + ".",
        f"Longest sequence whose measured per-rank peak (one whole step with optimizer state, max over ranks) stays "
        f"within {result['budget_gib']:g} GiB = {result['budget_bytes'] / MiB:.1f} MiB; S doubles from "
        f"{result['start']} up to {result['cap']}. Run took {meta['elapsed_s']:.0f} s ({meta['date']}).",
        "",
        "| scheme | mesh | longest S | peak MiB at longest S | predicted MiB | stopped because |",
        "|---|---|---:|---:|---:|---|",
    ]
    for s in _order(result["schemes"]):
        r = result["schemes"][s]
        at = next((t for t in r["tried"] if t["seq_len"] == r["longest_seq_len"]), {})
        lines.append(f"| {s} | {r['mesh']} | {r['longest_seq_len'] or 'none'} | {_mib(at.get('peak_bytes'))} "
                     f"| {_mib(at.get('predicted_peak_bytes'))} | {r['stopped']} |")
    lines += ["", "Every measurement:", "", "| scheme | S | peak MiB | predicted MiB | error |",
              "|---|---:|---:|---:|---:|"]
    for s in _order(result["schemes"]):
        for t in result["schemes"][s]["tried"]:
            if t["status"] != "ok":
                lines.append(f"| {s} | {t['seq_len']} | {t['status']} |  |  |")
            else:
                lines.append(f"| {s} | {t['seq_len']} | {_mib(t['peak_bytes'])} | {_mib(t['predicted_peak_bytes'])} "
                             f"| {_pct(t['peak_error_pct'])} |")
    return "\n".join(lines) + "\n"


def max_seq_figure(result: dict):
    fig, ax = _figure()
    seqs, shown = set(), [result["budget_bytes"] / MiB]
    order = _order(result["schemes"])
    for i, s in enumerate(order):
        pts = [(t["seq_len"], t["peak_bytes"]) for t in result["schemes"][s]["tried"] if t["status"] == "ok"]
        if pts:
            seqs |= {p[0] for p in pts}
            shown += [p[1] / MiB for p in pts]
            ax.plot(_dodged([p[0] for p in pts], i, len(order)), [p[1] / MiB for p in pts], **_style(s),
                    label=series_label(s, result["schemes"][s].get("mesh")))
    ax.axhline(result["budget_bytes"] / MiB, color="k", ls=":", lw=1, label=f"budget {result['budget_gib']:g} GiB")
    _log_axis(ax, shown)
    ax.set_ylabel("measured per-rank peak (MiB)")
    if seqs:
        _seq_axis(ax, seqs)
    ax.set_title(f"Longest sequence within {result['budget_gib']:g} GiB per rank, {result['meta']['world']} ranks",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_max_seq(result: dict, path: Path) -> Path:
    max_seq_figure(result).savefig(path)
    return path


def write_max_seq(result: dict, out: Path, plots: bool = True) -> list[Path]:
    """max_seq.json, max_seq.md and (``plots``) max_seq.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "max_seq.json", out / "max_seq.md"]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    files[1].write_text(max_seq_markdown(result))
    if plots:
        files.append(plot_max_seq(result, out / "max_seq.png"))
    return files


# ---------------------------------------------------------------- --mode infer


def infer_markdown(result: dict) -> str:
    meta = result["meta"]
    lines = ["# torchtsp bench --mode infer", "", _model_line(meta) + ".",
             f"generate: the prompt(s), then {meta.get('new_tokens', '?')} new tokens, greedy; schemes timed "
             f"interleaved per prompt length (built side by side, then {meta.get('steps', '?')} generate runs each in "
             f"alternating order). TTFT = prefill of the prompt to the first token, TPOT = mean time per output "
             f"token after it (slowest rank), both the median over the runs, TPOT with its range; TPOT/TP = TSP's "
             f"TPOT over TP's in the same run, median [range]; peak = live tensor bytes of the whole generate "
             f"call, max over ranks, against the analytic model (``plan --mode infer``); KV = this rank's cache.", ""]
    if "max_context" in result:
        mc = result["max_context"]
        lines += [f"Longest prompt whose per-rank peak stays within {mc['budget_gib']:g} GiB:", "",
                  "| scheme | longest prompt |", "|---|---:|"]
        lines += [f"| {s} | {n if n is not None else 'none'} |" for s, n in mc["longest_prompt"].items()]
        return "\n".join(lines) + "\n"
    lines += ["| prompt | scheme | TTFT ms | TPOT ms [range] | TPOT/TP [range] | peak MiB/rank | predicted MiB | "
              "error | KV MiB/rank | KV layout | schedule |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(result["infer"], key=lambda r: (r["prompt_len"], _rank(r["scheme"]))):
        if "error" in r:
            lines.append(f"| {r['prompt_len']} | {r['scheme']} | n/a: {r['error']} | | | | | | | | |")
            continue
        sched = "/".join(dict.fromkeys(r["schedule"].values()))
        lines.append(f"| {r['prompt_len']} | {r['scheme']} | {r['ttft_s'] * 1e3:.0f} | {tpot_text(r)} | "
                     f"{ratio_text(r)} | {_mib(r['peak_bytes_per_rank'])} | {_mib(r.get('predicted_peak_bytes'))} | "
                     f"{_pct(r.get('peak_error_pct'))} | {_mib(r['kv_bytes_per_rank'])} | {r.get('kv_layout', '')} | "
                     f"{sched} |")
    return "\n".join(lines) + "\n"


def infer_figure(result: dict):
    rows = [r for r in result["infer"] if "error" not in r]
    fig, axes = _figure(width=12.8, ncols=2)
    order = _order(r["scheme"] for r in rows)
    for i, s in enumerate(order):
        pts = sorted((r["prompt_len"], r["peak_bytes_per_rank"], r["tpot_s"]) for r in rows if r["scheme"] == s)
        xs = _dodged([p[0] for p in pts], i, len(order))
        axes[0].plot(xs, [p[1] / MiB for p in pts], **_style(s), label=s)
        axes[1].plot(xs, [p[2] * 1e3 for p in pts], **_style(s), label=s)
    for ax, title, unit in ((axes[0], "per-rank peak memory (generate)", "MiB"),
                            (axes[1], "time per output token", "ms")):
        _seq_axis(ax, sorted({r["prompt_len"] for r in rows}))
        ax.set_xlabel("prompt length")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
    return fig


def plot_infer(result: dict, path: Path) -> Path:
    infer_figure(result).savefig(path, dpi=110, bbox_inches="tight")
    return path


def write_infer(result: dict, out: Path, plots: bool = True) -> list[Path]:
    """infer.json, infer.md and (``plots``, sweep only) infer.png in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = "max_context" if "max_context" in result else "infer"
    files = [out / f"{stem}.json", out / f"{stem}.md"]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    files[1].write_text(infer_markdown(result))
    if plots and "infer" in result:
        files.append(plot_infer(result, out / "infer.png"))
    return files


def documents_markdown(result: dict) -> str:
    meta, rows = result["meta"], result["documents"]
    lines = [f"# torchtsp bench: document masking ({meta['world']} ranks, {meta['device']}, {meta['backend']})", "",
             _model_line(meta), "",
             f"Rows packed with documents of mean length {rows[0]['mean_document_len'] if rows else '-'} tokens "
             f"(exponential lengths, seeded); each scheme's step (forward + backward + AdamW) timed with and "
             f"without the document mask, interleaved on the same ranks and batch ({meta['steps']} steps each, "
             f"median); peaks are live tensors of one step, largest over ranks.", "",
             "| scheme | mesh | S | unmasked step | masked step | speedup | unmasked peak (MiB) | masked peak (MiB) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {r['mesh']} | {r['seq_len']} | {r['status']} | | | | |")
            continue
        a, b = r["unmasked"], r["masked"]
        lines.append(f"| {r['scheme']} | {r['mesh']} | {r['seq_len']} | {a['median_step_s'] * 1e3:,.0f} ms | "
                     f"{b['median_step_s'] * 1e3:,.0f} ms | {r['speedup']:.2f}x | {_mib(a['peak_bytes'])} | "
                     f"{_mib(b['peak_bytes'])} |")
    return "\n".join(lines) + "\n"


def write_documents(result: dict, out: Path) -> list[Path]:
    """documents.json and documents.md in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "documents.json", out / "documents.md"]
    files[0].write_text(json.dumps(result, indent=2) + "\n")
    files[1].write_text(documents_markdown(result))
    return files
