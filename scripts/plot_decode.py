#!/usr/bin/env python3
"""Draws decode bandwidth (GB/s) against the cache length sk from the JSON lines that
scripts/decode_side_by_side.py prints, as an SVG with no plotting library:

    python3 scripts/plot_decode.py --out docs/figures/decode-h100.svg --title "..." \
        --ceiling 3005 "copy bandwidth" \
        ours:docs/logs/a.log torch-cudnn=cuDNN:docs/logs/a.log torch-flash=flash:docs/logs/b.log

Each series is KIND[=LABEL]:FILE with KIND `ours` (the ours_gbps of every line), `ours-paged`
(the same, labelled as paged), `torch-*` (torch_gbps) or `mem` (mem_gbps, the machine's read
bandwidth measured in the run).
"""
import argparse, json, math

COLORS = ["#1f77b4", "#17becf", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"]


def lines_of(path):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                out.append(json.loads(line))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--ceiling", nargs=2, metavar=("GBPS", "LABEL"))
    ap.add_argument("series", nargs="+")
    args = ap.parse_args()

    series = []
    for spec in args.series:
        kind, path = spec.split(":", 1)
        label = kind
        if "=" in kind:
            kind, label = kind.split("=", 1)
        pts = []
        for j in lines_of(path):
            key = {"ours": "ours_gbps", "ours-paged": "ours_gbps", "mem": "mem_gbps"}.get(kind, "torch_gbps")
            if j.get(key) is not None:
                pts.append((j["sk"], j[key]))
        series.append((label, sorted(pts)))

    W, H, L, R, T, B = 760, 460, 70, 200, 50, 60
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    if args.ceiling:
        ys.append(float(args.ceiling[0]))
    x0, x1 = math.log2(min(xs)), math.log2(max(xs))
    y1 = max(ys) * 1.1
    px = lambda x: L + (math.log2(x) - x0) / max(x1 - x0, 1e-9) * (W - L - R)
    py = lambda y: H - B - y / y1 * (H - T - B)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="24" text-anchor="middle" font-size="14">{args.title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 20}" text-anchor="middle">cached tokens sk (log scale)</text>',
           f'<text x="18" y="{(T + H - B) / 2}" text-anchor="middle" transform="rotate(-90 18 {(T + H - B) / 2})">'
           f'GB/s (K+V bytes / time)</text>']
    for x in sorted(set(xs)):
        label = f"{x // 1024}k" if x >= 1024 else str(x)
        out.append(f'<line x1="{px(x):.1f}" y1="{H - B}" x2="{px(x):.1f}" y2="{H - B + 5}" stroke="black"/>')
        out.append(f'<text x="{px(x):.1f}" y="{H - B + 18}" text-anchor="middle">{label}</text>')
    step = 10 ** math.floor(math.log10(y1 / 5))
    step *= 5 if y1 / step > 25 else (2 if y1 / step > 10 else 1)
    y = 0.0
    while y <= y1:
        out.append(f'<line x1="{L - 5}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
        y += step
    if args.ceiling:
        c = float(args.ceiling[0])
        out.append(f'<line x1="{L}" y1="{py(c):.1f}" x2="{W - R}" y2="{py(c):.1f}" stroke="black" '
                   f'stroke-dasharray="6,4"/>')
        out.append(f'<text x="{W - R + 6}" y="{py(c) + 4:.1f}">{args.ceiling[1]} ({c:g})</text>')
    for k, (label, pts) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(pts))
        out.append(f'<path d="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        ly = T + 20 + 20 * k
        out.append(f'<line x1="{W - R + 10}" y1="{ly}" x2="{W - R + 30}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{W - R + 36}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
