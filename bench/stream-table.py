#!/usr/bin/env python3
"""Seed 003's tables and plots from bench/stream-compare.sh logs.

Reads one or more logs of `bench/stream-compare.sh --log FILE` (one per run), takes the
geometric mean of each cell over the runs, and prints Markdown tables: consume over AMQP 0.9.1
(PerfTest), over the stream protocol (RabbitMQ's Java client; the Rust client for Warren),
and publish with confirms, each with the broker's CPU time per message. With `--svg DIR` it
also writes seed 003's plots, one per protocol and message size (amqp091-12.svg, stream-12.svg,
...): msg/s per chunk size for Warren with read-ahead off, on, and RabbitMQ, and below it the
broker's CPU microseconds per message. Hand-written SVG: no plotting dependency.

`--check` (CI): exits 1 unless every cell has every figure that any cell has (a client that
failed in one cell leaves a hole there).

Usage: bench/stream-table.py [--check] [--svg DIR] LOG...
"""

import math
import os
import re
import sys
from collections import defaultdict

# Who a line's label names: Warren's two consume runs, Warren's fill, RabbitMQ.
def who(label):
    label = label.strip()
    if "exact fill" in label:
        # A broker refilled one batch in flight (EXACT=1): not a publish rate to compare.
        return None
    if label.startswith("RabbitMQ"):
        return "rmq"
    if "read-ahead off" in label:
        return "off"
    if "read-ahead" in label:
        return "ra"
    if label.startswith("warren"):
        return "warren"
    return None


CELL = r"bench-(\d+)-(\d+)"
PATTERNS = [
    # (metric, regex with groups size, chunk, value, label)
    ("fill", re.compile(r"^fill\s+" + CELL + r"\s+([\d.]+) msg/s published with confirms (.*)$")),
    ("java", re.compile(r"^java\s+" + CELL + r"\s+([\d.]+) msg/s (.*)$")),
    ("perftest", re.compile(r"^perftest " + CELL + r" ([\d.]+) msg/s (.*)$")),
    ("raw", re.compile(r"^raw\s+" + CELL + r"\s+([\d.]+) msg/s (.*)$")),
    ("amqp", re.compile(r"^amqp\s+" + CELL + r"\s+([\d.]+) msg/s (.*)$")),
    ("rust", re.compile(r"^consume\s+" + CELL + r"\s+size\s+\d+ chunk\s+\d+:\s+([\d.]+) msg/s (.*)$")),
    ("cpu-", re.compile(r"^cpu\s+(\w+)\s+" + CELL + r"\s+([\d.]+) us/msg broker (.*)$")),
]
RMQ_CHUNKS = re.compile(r"^rmq-chunks " + CELL + r" (\d+)$")


def parse(paths):
    """{(metric, who): {(size, chunk): [value per run]}}, {(size, chunk): [rmq chunks]}"""
    values = defaultdict(lambda: defaultdict(list))
    chunks = defaultdict(list)
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.rstrip("\n")
                m = RMQ_CHUNKS.match(line)
                if m:
                    chunks[(int(m[1]), int(m[2]))].append(int(m[3]))
                    continue
                for metric, rx in PATTERNS:
                    m = rx.match(line)
                    if not m:
                        continue
                    g = list(m.groups())
                    if metric == "cpu-":
                        metric = "cpu-" + g.pop(0)
                    size, chunk, value, label = int(g[0]), int(g[1]), float(g[2]), g[3]
                    w = who(label)
                    if w is not None:
                        values[(metric, w)][(size, chunk)].append(value)
                    break
    return values, chunks


def messages_per_cell(paths):
    """The run's messages per cell, from its first line (`...; N messages per cell`)."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = re.search(r"(\d+) messages per cell", line)
                if m:
                    return int(m[1])
    return None


def gmean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def cell(values, metric, w, key):
    return gmean(values.get((metric, w), {}).get(key, []))


def fmt_rate(v):
    return "" if v is None else f"{v:,.0f}"


def fmt_ratio(a, b):
    return "" if a is None or b is None else f"{a / b:.1f}"


def fmt_us(v):
    return "" if v is None else f"{v:.2f}"


def table(title, header, rows):
    out = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def ratio_means(values, keys, metric, a, b):
    rs = []
    for k in keys:
        x, y = cell(values, metric, a, k), cell(values, metric, b, k)
        if x and y:
            rs.append(x / y)
    return gmean(rs), len(rs)


def render_tables(values, chunks, runs, messages):
    keys = sorted({k for per in values.values() for k in per})
    out = [f"Geometric means over {runs} run(s) per cell.\n"]
    rows = []
    for k in keys:
        off, ra, rmq = (cell(values, "perftest", w, k) for w in ("off", "ra", "rmq"))
        rows.append([f"{k[0]} B", str(k[1]), fmt_rate(off), fmt_rate(ra), fmt_ratio(ra, off),
                     fmt_rate(rmq), fmt_ratio(ra, rmq)]
                    + [fmt_us(cell(values, "cpu-perftest", w, k)) for w in ("off", "ra", "rmq")])
    out.append(table(
        "Consume over AMQP 0.9.1, PerfTest (msg/s; broker CPU us per message)",
        ["message", "chunk", "Warren off", "Warren RA", "RA/off", "RabbitMQ", "Warren RA / RabbitMQ",
         "CPU off", "CPU RA", "CPU RabbitMQ"], rows))
    rows = []
    for k in keys:
        off, ra, rmq = (cell(values, "amqp", w, k) for w in ("off", "ra", "rmq"))
        if off is None and ra is None and rmq is None:
            continue
        rows.append([f"{k[0]} B", str(k[1]), fmt_rate(off), fmt_rate(ra), fmt_ratio(ra, off),
                     fmt_rate(rmq), fmt_ratio(ra, rmq)]
                    + [fmt_us(cell(values, "cpu-amqp", w, k)) for w in ("off", "ra", "rmq")])
    if rows:
        out.append(table(
            "Consume over AMQP 0.9.1, warren-bench's client (PerfTest's settings: qos 200, offset "
            "first, an ack per message; msg/s; broker CPU us per message)",
            ["message", "chunk", "Warren off", "Warren RA", "RA/off", "RabbitMQ",
             "Warren RA / RabbitMQ", "CPU off", "CPU RA", "CPU RabbitMQ"], rows))
    rows = []
    for k in keys:
        off, ra, rmq = (cell(values, "java", w, k) for w in ("off", "ra", "rmq"))
        got = chunks.get(k)
        rows.append([f"{k[0]} B", str(k[1]), fmt_rate(off), fmt_rate(ra), fmt_ratio(ra, off),
                     fmt_rate(rmq),
                     "" if not got or not messages else f"{messages / gmean(got):,.0f}",
                     fmt_ratio(ra, rmq)]
                    + [fmt_us(cell(values, "cpu-java", w, k)) for w in ("off", "ra", "rmq")]
                    + [fmt_rate(cell(values, "rust", w, k)) for w in ("off", "ra")])
    out.append(table(
        "Consume over the stream protocol, RabbitMQ's Java client (msg/s; broker CPU us per "
        "message; RabbitMQ's messages per chunk as its index files count its chunks: its writer "
        "merges what is queued)",
        ["message", "chunk", "Warren off", "Warren RA", "RA/off", "RabbitMQ", "RabbitMQ msgs/chunk",
         "Warren RA / RabbitMQ", "CPU off", "CPU RA", "CPU RabbitMQ", "Rust client off",
         "Rust client RA"], rows))
    rows = []
    for k in keys:
        off, ra, rmq = (cell(values, "raw", w, k) for w in ("off", "ra", "rmq"))
        if off is None and ra is None and rmq is None:
            continue
        coff, cra, crmq = (cell(values, "cpu-raw", w, k) for w in ("off", "ra", "rmq"))
        rows.append([f"{k[0]} B", str(k[1]), fmt_rate(off), fmt_rate(ra), fmt_ratio(ra, off),
                     fmt_rate(rmq), fmt_ratio(ra, rmq), fmt_us(coff), fmt_us(cra), fmt_us(crmq),
                     fmt_ratio(coff, cra), fmt_ratio(crmq, cra)])
    if rows:
        out.append(table(
            "Consume over the stream protocol, warren-bench's raw-frame consumer (records counted "
            "from chunk headers, a credit per chunk; msg/s; broker CPU us per message)",
            ["message", "chunk", "Warren off", "Warren RA", "RA/off", "RabbitMQ",
             "Warren RA / RabbitMQ", "CPU off", "CPU RA", "CPU RabbitMQ", "CPU off/RA",
             "CPU RabbitMQ / Warren RA"], rows))
    rows = []
    for k in keys:
        w, r = cell(values, "fill", "warren", k), cell(values, "fill", "rmq", k)
        rows.append([f"{k[0]} B", str(k[1]), fmt_rate(w), fmt_rate(r), fmt_ratio(w, r),
                     fmt_us(cell(values, "cpu-fill", "warren", k)),
                     fmt_us(cell(values, "cpu-fill", "rmq", k))])
    out.append(table(
        "Publish with confirms, RabbitMQ's Java stream client, 20,000 in flight (msg/s; broker "
        "CPU us per message)",
        ["message", "chunk", "Warren", "RabbitMQ", "Warren / RabbitMQ", "CPU Warren",
         "CPU RabbitMQ"], rows))
    lines = ["Geometric means over cells (cells with both values):", ""]
    for name, metric, a, b in [
        ("AMQP RA/off", "perftest", "ra", "off"),
        ("AMQP Warren RA / RabbitMQ", "perftest", "ra", "rmq"),
        ("AMQP broker CPU off/RA", "cpu-perftest", "off", "ra"),
        ("AMQP broker CPU RabbitMQ / Warren RA", "cpu-perftest", "rmq", "ra"),
        ("AMQP (warren-bench client) RA/off", "amqp", "ra", "off"),
        ("AMQP (warren-bench client) Warren RA / RabbitMQ", "amqp", "ra", "rmq"),
        ("AMQP (warren-bench client) broker CPU off/RA", "cpu-amqp", "off", "ra"),
        ("stream (raw consumer) RA/off", "raw", "ra", "off"),
        ("stream (raw consumer) Warren RA / RabbitMQ", "raw", "ra", "rmq"),
        ("stream (raw consumer) broker CPU off/RA", "cpu-raw", "off", "ra"),
        ("stream (raw consumer) broker CPU RabbitMQ / Warren RA", "cpu-raw", "rmq", "ra"),
        ("stream RA/off", "java", "ra", "off"),
        ("stream Warren RA / RabbitMQ", "java", "ra", "rmq"),
        ("stream broker CPU off/RA", "cpu-java", "off", "ra"),
        ("stream broker CPU RabbitMQ / Warren RA", "cpu-java", "rmq", "ra"),
        ("publish Warren / RabbitMQ", "fill", "warren", "rmq"),
        ("publish broker CPU RabbitMQ / Warren", "cpu-fill", "rmq", "warren"),
    ]:
        g, n = ratio_means(values, keys, metric, a, b)
        if g is not None:
            one = [k for k in keys if k[1] == 1]
            g1, n1 = ratio_means(values, one, metric, a, b)
            extra = f"; 1-message chunks {g1:.2f} ({n1})" if g1 is not None else ""
            lines.append(f"- {name}: {g:.2f} ({n} cells){extra}")
    for name, metric, a in [("AMQP, PerfTest", "perftest", "ra"),
                            ("AMQP, warren-bench client", "amqp", "ra"),
                            ("stream protocol, Java client", "java", "ra"),
                            ("publish with confirms", "fill", "warren")]:
        both = [k for k in keys if cell(values, metric, a, k) and cell(values, metric, "rmq", k)]
        behind = [f"{k[0]} B x {k[1]}" for k in both
                  if cell(values, metric, a, k) < cell(values, metric, "rmq", k)]
        if both:
            lines.append(f"- {name}: Warren behind RabbitMQ in {len(behind)} of {len(both)} cells"
                         + (f" ({', '.join(behind)})" if behind else ""))
    out.append("\n".join(lines) + "\n")
    return "\n".join(out)


# --- SVG: grouped bars per chunk size, rate on top, broker CPU per message below.
SERIES = [("off", "Warren read-ahead off", "#9ecae1"), ("ra", "Warren read-ahead on", "#08519c"),
          ("rmq", "RabbitMQ 3.10.8", "#f16913")]


def nice_max(v):
    if not v or v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * e:
            return m * e
    return 10 * e


def esc(t):
    return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def panel(svg, top, height, title, chunk_list, data, fmt):
    left, width = 80.0, 640.0
    vmax = nice_max(max([v for per in data.values() for v in per.values() if v] or [0]))
    svg.append(f'<text x="{left}" y="{top - 8}" font-size="13">{esc(title)}</text>')
    for i in range(5):
        v = vmax * i / 4
        y = top + height - height * i / 4
        svg.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + width}" y2="{y:.1f}" stroke="#ddd"/>')
        svg.append(f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{fmt(v)}</text>')
    group = width / max(len(chunk_list), 1)
    bar = group * 0.8 / len(SERIES)
    for gi, c in enumerate(chunk_list):
        x0 = left + gi * group + group * 0.1
        for si, (w, _, color) in enumerate(SERIES):
            v = data.get(w, {}).get(c)
            if not v:
                continue
            h = height * v / vmax
            svg.append(f'<rect x="{x0 + si * bar:.1f}" y="{top + height - h:.1f}" width="{bar - 1:.1f}" '
                       f'height="{h:.1f}" fill="{color}"><title>{esc(fmt(v))}</title></rect>')
        svg.append(f'<text x="{left + gi * group + group / 2:.1f}" y="{top + height + 16}" font-size="11" '
                   f'text-anchor="middle">{c}</text>')
    svg.append(f'<text x="{left + width / 2}" y="{top + height + 32}" font-size="11" '
               f'text-anchor="middle">messages per chunk</text>')


def plot(path, title, chunk_list, rates, cpus):
    svg = ['<svg xmlns="http://www.w3.org/2000/svg" width="760" height="560" font-family="sans-serif">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="380" y="22" font-size="15" text-anchor="middle">{esc(title)}</text>']
    for i, (_, name, color) in enumerate(SERIES):
        svg.append(f'<rect x="{90 + i * 210}" y="34" width="12" height="12" fill="{color}"/>')
        svg.append(f'<text x="{106 + i * 210}" y="45" font-size="12">{esc(name)}</text>')
    panel(svg, 80, 230, "msg/s", chunk_list, rates,
          lambda v: f"{v / 1e6:.1f}M" if v >= 1e6 else f"{v / 1e3:.0f}k")
    panel(svg, 370, 140, "broker CPU per message (us)", chunk_list, cpus, lambda v: f"{v:.2f}")
    svg.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(svg) + "\n")


def write_svgs(values, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    keys = sorted({k for per in values.values() for k in per})
    written = []
    for proto, metric, cpu, name in [("amqp091", "perftest", "cpu-perftest", "AMQP 0.9.1 (PerfTest)"),
                                     ("stream", "java", "cpu-java", "stream protocol (Java client)")]:
        for size in sorted({k[0] for k in keys}):
            cs = sorted(k[1] for k in keys if k[0] == size)
            rates = {w: {c: cell(values, metric, w, (size, c)) for c in cs} for w, _, _ in SERIES}
            cpus = {w: {c: cell(values, cpu, w, (size, c)) for c in cs} for w, _, _ in SERIES}
            if not any(v for per in rates.values() for v in per.values()):
                continue
            path = os.path.join(out_dir, f"{proto}-{size}.svg")
            plot(path, f"{size}-byte messages, {name}", cs, rates, cpus)
            written.append(path)
    return written


def holes(values):
    """The (metric, who, cell) missing where other cells have that metric and who."""
    keys = sorted({k for per in values.values() for k in per})
    return [(m, w, k) for (m, w), per in sorted(values.items()) for k in keys if k not in per]


def main(argv):
    svg, check = None, False
    while argv and argv[0] in ("--svg", "--check"):
        if argv[0] == "--check":
            check, argv = True, argv[1:]
        elif len(argv) >= 2:
            svg, argv = argv[1], argv[2:]
        else:
            break
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    values, chunks = parse(argv)
    if not values:
        print("no results in " + ", ".join(argv), file=sys.stderr)
        return 1
    print(render_tables(values, chunks, len(argv), messages_per_cell(argv)))
    missing = holes(values)
    for m, w, k in missing:
        print(f"missing: {m} of {w} for {k[0]} B x {k[1]}", file=sys.stderr)
    if check and missing:
        return 1
    if svg:
        for p in write_svgs(values, svg):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
