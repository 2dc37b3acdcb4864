#!/usr/bin/env python3
"""bench/report.py RESULTS_DIR: the summary of a bench/run.sh matrix run (python3, no packages).

Reads RESULTS_DIR/json/BACKEND/FILE.repN.json (fio JSON: rpma-initiator bench --job, or fio),
RESULTS_DIR/cpu.tsv, RESULTS_DIR/floor.txt and RESULTS_DIR/machine.txt; writes
RESULTS_DIR/summary.md (medians over the repetitions; rpma, the peer and the ratio on every row)
and the plots lat-percentiles.svg, iops-vs-qd.svg, bw-vs-qd.svg.
"""
import json
import math
import os
import re
import statistics
import sys

# (key, label, kind): kind "rpma" or "peer"; the pairs compared are listed in PAIRS.
BACKENDS = [
    ("rpma-dax", "rpma native, /dev/shm dax (forced)"),
    ("nbdkit-shm", "nbdkit file, /dev/shm"),
    ("rpma-disk", "rpma native, disk (page-cache)"),
    ("nbdkit-disk", "nbdkit file, disk"),
    ("rpma-nbd-dax", "rpma NBD export (fio nbd), /dev/shm dax"),
]
# (rpma, peer): the columns of the table, each followed by the ratio.
PAIRS = [("rpma-dax", "nbdkit-shm"), ("rpma-disk", "nbdkit-disk"), ("rpma-nbd-dax", "nbdkit-shm")]
COLORS = {
    "rpma-dax": "#d62728",
    "rpma-disk": "#ff7f0e",
    "rpma-nbd-dax": "#9467bd",
    "nbdkit-shm": "#1f77b4",
    "nbdkit-disk": "#2ca02c",
}
PCTS = ["1.000000", "10.000000", "50.000000", "90.000000", "99.000000", "99.900000"]


def load(root):
    """{backend: {jobname: [job object per repetition]}}"""
    out = {}
    base = os.path.join(root, "json")
    for b in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        for f in sorted(os.listdir(os.path.join(base, b))):
            if not f.endswith(".json"):
                continue
            with open(os.path.join(base, b, f)) as fh:
                text = fh.read()
            # fio may print notes before the document.
            doc = json.loads(text[text.index("{"):])
            for j in doc["jobs"]:
                if j.get("error", 0) != 0:
                    continue
                out.setdefault(b, {}).setdefault(j["jobname"], []).append(j)
    return out


def direction(j):
    """The direction a section measures (writes when it writes only)."""
    if j["read"]["total_ios"] == 0:
        return "write"
    if j["write"]["total_ios"] == 0:
        return "read"
    return "both"


def pct_us(j, p):
    """A completion-latency percentile in us. fio times a write and the fsync after it apart
    (write clat_ns, sync lat_ns): for fsync=1 rows the two percentiles are added, an
    approximation (rpma-initiator's write clat already includes the durability)."""
    d = direction(j)
    v = j[d]["clat_ns"].get("percentile", {}).get(p, 0)
    sync = j.get("sync", {})
    if d == "write" and sync.get("total_ios", 0) > 0:
        v += sync["lat_ns"].get("percentile", {}).get(p, 0)
    return v / 1000.0


def metric(name, j):
    """(value, unit, higher_is_better) of a section: the figure its row shows."""
    d = direction(j)
    if name.startswith("lat-"):
        return pct_us(j, "50.000000"), "p50 us", False
    if name.startswith("bw-"):
        return j[d]["bw_bytes"] / 2**20, "MiB/s", True
    if d == "both":
        return j["read"]["iops"] + j["write"]["iops"], "IOPS", True
    return j[d]["iops"], "IOPS", True


def p99(name, j):
    return pct_us(j, "99.000000")


def mean_us(name, j):
    """The mean time of one operation at QD1, exact for both tools: 1 / IOPS."""
    iops = j["read"]["iops"] + j["write"]["iops"]
    return 1e6 / iops if iops else None


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(v):
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def ratio(r, p, higher):
    if r is None or p is None or r == 0 or p == 0:
        return "-"
    return f"{(r / p if higher else p / r):.2f}x"


def table(data):
    names = []
    for b in data.values():
        for n in b:
            if n not in names:
                names.append(n)
    head = "| job | figure |"
    rule = "|---|---|"
    for r, p in PAIRS:
        head += f" {r} | {p} | x |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    for n in names:
        for what in ("median", "p99", "mean"):
            if what != "median" and not n.startswith("lat-"):
                continue
            row, unit = [], ""
            for r, p in PAIRS:
                vals = []
                for b in (r, p):
                    reps = data.get(b, {}).get(n, [])
                    if what == "median":
                        ms = [metric(n, j) for j in reps]
                        unit = ms[0][1] if ms else unit
                        higher = ms[0][2] if ms else True
                        vals.append(med([m[0] for m in ms]))
                    elif what == "p99":
                        unit, higher = "p99 us", False
                        vals.append(med([p99(n, j) for j in reps]))
                    else:
                        unit, higher = "mean us (1/IOPS)", False
                        vals.append(med([mean_us(n, j) for j in reps]))
                row += [fmt(vals[0]), fmt(vals[1]), ratio(vals[0], vals[1], higher)]
            lines.append(f"| {n} | {unit} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def cpu_table(root, data):
    path = os.path.join(root, "cpu.tsv")
    if not os.path.exists(path):
        return ""
    idle, busy = {}, {}
    with open(path) as fh:
        for line in fh:
            f = line.split()
            if len(f) != 4:
                continue
            backend, what, rep, secs = f[0], f[1], f[2], float(f[3])
            if what == "idle":
                idle.setdefault(backend, []).append(secs)
            else:
                busy.setdefault((backend, what), []).append((rep, secs))
    lines = [
        "| server | idle CPU over 10 s (% of one CPU) | server CPU us per op, iops.fio | server CPU us per op, lat.fio | client CPU us per op, iops.fio |",
        "|---|---:|---:|---:|---:|",
    ]
    for b, label in BACKENDS:
        cells = []
        m = med([s / 10 * 100 for s in idle.get(b, [])])
        cells.append("-" if m is None else f"{m:.2f}")
        for f in ("iops", "lat"):
            per = []
            for rep, secs in busy.get((b, f), []):
                ios = 0
                jp = os.path.join(root, "json", b, f"{f}.rep{rep}.json")
                if os.path.exists(jp):
                    with open(jp) as fh:
                        t = fh.read()
                    doc = json.loads(t[t.index("{"):])
                    ios = sum(j["read"]["total_ios"] + j["write"]["total_ios"] for j in doc["jobs"])
                if ios:
                    per.append(secs / ios * 1e6)
            cells.append(fmt(med(per)))
        # The client's own account (fio's and rpma-initiator's usr_cpu + sys_cpu, % of the
        # section's runtime), per operation.
        per = []
        for rep in sorted({r for r, _ in busy.get((b, "iops"), [])}):
            jp = os.path.join(root, "json", b, f"iops.rep{rep}.json")
            if not os.path.exists(jp):
                continue
            with open(jp) as fh:
                t = fh.read()
            doc = json.loads(t[t.index("{"):])
            secs = sum((j["usr_cpu"] + j["sys_cpu"]) / 100 * j["job_runtime"] / 1000 for j in doc["jobs"])
            ios = sum(j["read"]["total_ios"] + j["write"]["total_ios"] for j in doc["jobs"])
            if ios:
                per.append(secs / ios * 1e6)
        cells.append(fmt(med(per)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- SVG, by hand -------------------------------------------------------------------------------

def panel(x0, title, xlabels, series, log_y, ylabel, w=300, h=220):
    """One line chart at x offset x0: series = {backend: [y or None per x]}."""
    ys = [v for s in series.values() for v in s if v]
    if not ys:
        return ""
    lo, hi = min(ys), max(ys)
    if log_y:
        lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
        if lo == hi:
            hi = lo * 10
    else:
        lo, hi = 0, hi * 1.1
    L, T, R, B = 55, 30, 10, 35
    pw, ph = w - L - R, h - T - B

    def sx(i):
        return x0 + L + (pw * i / max(1, len(xlabels) - 1))

    def sy(v):
        if log_y:
            f = (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        else:
            f = (v - lo) / (hi - lo)
        return T + ph * (1 - f)

    out = [f'<text x="{x0 + w / 2}" y="16" text-anchor="middle" font-size="13">{title}</text>']
    out.append(f'<rect x="{x0 + L}" y="{T}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    ticks = []
    if log_y:
        v = lo
        while v <= hi * 1.0001:
            ticks.append(v)
            v *= 10
    else:
        ticks = [lo + (hi - lo) * k / 4 for k in range(5)]
    for t in ticks:
        y = sy(t)
        out.append(f'<line x1="{x0 + L}" y1="{y:.1f}" x2="{x0 + L + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 + L - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{fmt(t)}</text>')
    for i, lab in enumerate(xlabels):
        out.append(f'<text x="{sx(i):.1f}" y="{T + ph + 14}" text-anchor="middle" font-size="10">{lab}</text>')
    out.append(f'<text x="{x0 + 12}" y="{T + ph / 2}" font-size="10" transform="rotate(-90 {x0 + 12} {T + ph / 2})" text-anchor="middle">{ylabel}</text>')
    for b, vals in series.items():
        pts = [f"{sx(i):.1f},{sy(v):.1f}" for i, v in enumerate(vals) if v]
        if pts:
            out.append(f'<polyline fill="none" stroke="{COLORS.get(b, "#000")}" stroke-width="2" points="{" ".join(pts)}"/>')
            for p in pts:
                x, y = p.split(",")
                out.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{COLORS.get(b, "#000")}"/>')
    return "\n".join(out)


def svg(path, title, panels, backends):
    w = 300 * len(panels)
    h = 220 + 20 * ((len(backends) + 1) // 2) + 30
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">',
            f'<rect width="{w}" height="{h}" fill="white"/>']
    body.append(f'<g transform="translate(0,20)">')
    for i, p in enumerate(panels):
        body.append(panel(i * 300, *p))
    body.append("</g>")
    body.append(f'<text x="6" y="14" font-size="12" font-weight="bold">{title}</text>')
    for k, (b, label) in enumerate(backends):
        x, y = 10 + (k % 2) * (w / 2), 260 + 20 * (k // 2)
        body.append(f'<rect x="{x}" y="{y - 9}" width="12" height="10" fill="{COLORS.get(b, "#000")}"/>')
        body.append(f'<text x="{x + 16}" y="{y}" font-size="11">{label}</text>')
    body.append("</svg>")
    with open(path, "w") as fh:
        fh.write("\n".join(body) + "\n")


def plots(root, data):
    shown = [(b, l) for b, l in BACKENDS if b in data]

    def val(b, n, f):
        reps = data.get(b, {}).get(n, [])
        return med([f(j) for j in reps]) if reps else None

    lat = []
    for n in ("lat-randwrite-512", "lat-randwrite-4k", "lat-randwrite-64k", "lat-randread-4k"):
        series = {}
        for b, _ in shown:
            series[b] = [val(b, n, lambda j, p=p: pct_us(j, p)) for p in PCTS]
        lat.append((n.replace("lat-", ""), ["p1", "p10", "p50", "p90", "p99", "p99.9"], series, True, "us"))
    svg(os.path.join(root, "lat-percentiles.svg"), "QD1 completion latency percentiles (writes durable)", lat, shown)
    iops = []
    for rw in ("randwrite", "randread"):
        qds = [1, 4, 16, 64]
        series = {b: [val(b, f"iops-{rw}-qd{q}", lambda j: metric("iops", j)[0]) for q in qds] for b, _ in shown}
        iops.append((f"4 KiB {rw} IOPS", [f"QD{q}" for q in qds], series, False, "IOPS"))
    svg(os.path.join(root, "iops-vs-qd.svg"), "IOPS vs queue depth", iops, shown)
    bw = []
    for rw in ("write", "read"):
        qds = [1, 4, 16]
        series = {b: [val(b, f"bw-{rw}-qd{q}", lambda j: metric("bw-", j)[0]) for q in qds] for b, _ in shown}
        bw.append((f"1 MiB seq {rw} MiB/s", [f"QD{q}" for q in qds], series, False, "MiB/s"))
    svg(os.path.join(root, "bw-vs-qd.svg"), "Bandwidth vs queue depth", bw, shown)


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "bench/results"
    data = load(root)
    parts = []
    mp = os.path.join(root, "machine.txt")
    if os.path.exists(mp):
        parts.append(open(mp).read().strip())
    parts.append("Medians over the repetitions. `x`: how many times better rpma's figure is than the "
                 "peer's (throughput rpma/peer, latency peer/rpma; above 1: rpma better).\n")
    parts.append(table(data))
    c = cpu_table(root, data)
    if c:
        parts.append("\nCPU of the serving processes (rpma-target; rpma-target + rpma-initiator nbd; "
                     "nbdkit), from /proc/PID/stat:\n")
        parts.append(c)
    fp = os.path.join(root, "floor.txt")
    if os.path.exists(fp):
        parts.append("\nThe floor (common/examples/fabric_bench.rs over loopback: raw TCP, its "
                     "ping-pong also sent from random places in a 64 MiB dax (forced) region, its "
                     "stream also landed in dax (forced) regions of 16 and 64 MiB (written back "
                     "as it lands, or streamed in from a small buffer with non-temporal stores), "
                     "and sent with MSG_ZEROCOPY; the wire's own work alone (a Read, and a durable "
                     "Write with its Flush, framed, CRC'd and checked by the transport's wire code "
                     "over raw sockets, with no engine); and the tcp transport alone, a 4 KiB Write + an "
                     "8-byte APM "
                     "Read at QD1, 1 MiB Writes, on a dax (forced) region):\n")
        parts.append(open(fp).read().strip())
    with open(os.path.join(root, "summary.md"), "w") as fh:
        fh.write("\n".join(parts) + "\n")
    plots(root, data)
    print("\n".join(parts))


if __name__ == "__main__":
    main()
