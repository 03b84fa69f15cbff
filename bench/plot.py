#!/usr/bin/env python3
"""Draws the benchmark's chart with matplotlib from its JSON lines.

  bench/plot.py DIR [--out FILE] [--title TEXT]

DIR/summary.jsonl (deepclone_bench_mpi: median and min-max over the rounds per strategy and
link) is used when present, else DIR/results.jsonl (deepclone_bench: one line per
measurement). Two panels: readiness (bar: median, whiskers: min-max, black tick: the bound
max(S/NB, S/B)) and the source overhead of the fork, one row per (link, strategy).
Writes DIR/chart.png unless --out says otherwise."""
import argparse, json, math, os, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt


def rows(d):
    summ = os.path.join(d, "summary.jsonl")
    if os.path.exists(summ):
        out = []
        for l in open(summ):
            if not l.strip():
                continue
            r = json.loads(l)
            g = lambda k: (r[k]["median"], r[k]["min"], r[k]["max"])
            out.append(dict(label=f'{r["link"]} · {r["strategy"]}', ready=g("readiness_s"), over=g("overhead_s"),
                            bound=r["bound_s"], link=r["link"]))
        return out
    out = []
    for l in open(os.path.join(d, "results.jsonl")):
        if not l.strip():
            continue
        r = json.loads(l)
        name = r["strategy"] + (f' {r["pipeline"]}/{r["reconstruction"]}' if r["strategy"].startswith("deepclone") else "")
        one = lambda v: (v, v, v)
        out.append(dict(label=f'{r["link"]} · {r["trainer"]} · {name}', ready=one(r["readiness_s"]), over=one(r["overhead_s"]),
                        bound=r["bound_s"], link=r["link"]))
    return out


def num(v):
    return float("nan") if v is None else float(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--out")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    rs = rows(a.dir)
    if not rs:
        sys.exit("no measurements")
    n = len(rs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * n + 1.6), sharey=True)
    ys = list(range(n))[::-1]
    colors = {"raw": "#4878cf", "emulated": "#6acc65"}
    for ax, key, xlabel in ((ax1, "ready", "readiness (s); black tick: bound max(S/NB, S/B)"),
                            (ax2, "over", "source overhead of the fork (s)")):
        med = [num(r[key][0]) for r in rs]
        lo = [num(r[key][1]) for r in rs]
        hi = [num(r[key][2]) for r in rs]
        err = [[0 if math.isnan(m) else m - l for m, l in zip(med, lo)], [0 if math.isnan(m) else h - m for m, h in zip(med, hi)]]
        ax.barh(ys, [0 if math.isnan(m) else m for m in med], xerr=err, color=[colors.get(r["link"], "#999999") for r in rs],
                ecolor="black", capsize=2, height=0.7)
        span = max([h for h in hi if not math.isnan(h)] + [1e-9])
        for y, m, h in zip(ys, med, hi):
            if not math.isnan(m):
                ax.text(max(h, m, 0) + 0.01 * span, y, f"{m:.2f}", va="center", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
        ax.axvline(0, color="black", linewidth=0.6)
    for y, r in zip(ys, rs):
        ax1.plot([r["bound"], r["bound"]], [y - 0.4, y + 0.4], color="black", linewidth=2)
    ax1.set_yticks(ys)
    ax1.set_yticklabels([r["label"] for r in rs], fontsize=8)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    out = a.out or os.path.join(a.dir, "chart.png")
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
