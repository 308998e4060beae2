"""Writing a benchmark run: JSON (everything), a markdown table, and a plot of tokens/s
against batch size."""

from __future__ import annotations

import json
from pathlib import Path


def markdown(result: dict) -> str:
    env = result["environment"]
    hardware = env.get("gpu", env.get("cpu", "?"))
    lines = [
        f"Command: `{env['command']}` at commit `{env['commit'][:12]}`, {env['time']}.",
        f"Hardware: {hardware}{' (driver ' + env['driver'] + ')' if 'driver' in env else ''}; "
        f"torch {env['torch']}, transformers {env['transformers']}, specdec {env['specdec']}.",
        "",
        "| method | batch | tok/s | vs specdec plain | tau | identical | agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    plain = {r["batch"]: r["tokens_per_s"] for r in result["rows"] if r["method"].startswith("specdec plain")}
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"| {row['method']} | {row['batch']} | failed: {row['error'][:80]} | - | - | - | - |")
            continue
        base = plain.get(row["batch"])
        ratio = f"{row['tokens_per_s'] / base:.2f}x" if base else "-"
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        identical = {True: "yes", False: "no", None: "reference"}[row["identical"]]
        agreed = "-" if row["agreement"] != row["agreement"] else f"{row['agreement']:.0%}"
        lines.append(f"| {row['method']} | {row['batch']} | {row['tokens_per_s']:.1f} | {ratio} | {tau} | "
                     f"{identical} | {agreed} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = sorted({r["method"] for r in result["rows"]})
    for method in methods:
        rows = sorted((r for r in result["rows"] if r["method"] == method and not r["error"]), key=lambda r: r["batch"])
        if not rows:
            continue
        xs, ys = [r["batch"] for r in rows], [r["tokens_per_s"] for r in rows]
        style = "o-" if rows[0]["family"] == "specdec" else "s--"
        ax.plot(xs, ys, style, label=method)
    ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s (greedy)",
           title=f"{result['environment'].get('gpu', 'CPU')}: zoo '{result['settings']['preset']}'")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, folder: str | Path, stem: str) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.json", folder / f"{stem}.md", folder / f"{stem}.png"]
    paths[0].write_text(json.dumps(result, indent=2))
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths
