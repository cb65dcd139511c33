"""Compare compressors on the digits example: accuracy against step and against bytes sent.

Runs ``train_digits.py`` under torchrun (2 ranks by default, same seed and flags) for dense
fp32, Cast(bf16), TopK(0.01) with and without error feedback, and Threshold, then writes to
the output directory (default ``runs/compare/``):

- ``compare.png``: test accuracy against step and against megabytes sent (rank 0);
- ``results.md``: the measured table (final accuracy, MB sent, ratio to dense);
- ``<run>.jsonl`` and ``<run>.log``: each run's metrics and output.

    python examples/compare.py                       # all five runs, ~2 minutes on 2 CPU cores
    python examples/compare.py --steps 100 --runs dense topk-ef topk-no-ef
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import read_json_log  # noqa: E402


def run_specs(density: float, threshold: float) -> dict[str, tuple[str, list[str]]]:
    """``{run name: (label, train_digits.py flags)}``, in the order they are run and plotted."""
    return {
        "dense": ("Dense fp32", ["--compressor", "dense"]),
        "bf16": ("Cast(bf16)", ["--compressor", "bf16"]),
        "topk-ef": (f"TopK({density:g}) + EF", ["--compressor", "topk", "--density", str(density)]),
        "topk-no-ef": (
            f"TopK({density:g}) no EF",
            ["--compressor", "topk", "--density", str(density), "--no-error-feedback"],
        ),
        "threshold": (
            f"Threshold({threshold:g}) + EF",
            ["--compressor", "threshold", "--threshold", str(threshold)],
        ),
    }


def torchrun(nproc: int, script: Path, flags: list[str], log_path: Path, timeout: float) -> float:
    """Run ``script`` under torchrun with ``nproc`` ranks; output goes to ``log_path``.
    Returns the wall time; raises ``RuntimeError`` with the log's tail if the run fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HERE.parent), env.get("PYTHONPATH")] if p)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *flags,
    ]
    started = time.perf_counter()
    with open(log_path, "w") as log:
        result = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
        )
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{tail}")
    return time.perf_counter() - started


def summarize(records: list[dict]) -> dict:
    evals = [r for r in records if r["event"] == "eval"]
    trains = [r for r in records if r["event"] == "train"]
    final = next(r for r in records if r["event"] == "final")
    last = [r["test_accuracy"] for r in evals[-3:]]
    return {
        "final_accuracy": final["test_accuracy"],
        "last3_accuracy": sum(last) / len(last),
        "mb_sent": final["mb_sent"],
        "dense_mb": final["dense_mb"],
        "mean_density": sum(r["density"] for r in trains) / len(trains),
        "evals": evals,
    }


def write_table(rows: list[tuple[str, dict, float]], args, path: Path) -> str:
    dense = next((s for name, s, _ in rows if name == "dense"), None)
    lines = [
        f"digits CNN, {args.nproc} ranks (gloo, CPU), SGD momentum 0.9, lr {args.lr:g}, "
        f"{args.steps} steps of {args.batch_size} per rank, seed {args.seed}. "
        "MB sent: rank 0's payload into the collectives (StepStats.bytes_sent).",
        "",
        "| run | final test acc | mean of last 3 evals | MB sent | ratio to dense | "
        "mean density | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for _, s, seconds in rows:
        ratio = s["mb_sent"] / (dense or s)["mb_sent"] if (dense or s)["mb_sent"] else float("nan")
        lines.append(
            f"| {s['label']} | {100 * s['final_accuracy']:.2f}% | "
            f"{100 * s['last3_accuracy']:.2f}% | {s['mb_sent']:.2f} | {ratio:.4f} "
            f"(1/{1 / ratio:.1f}) | {100 * s['mean_density']:.2f}% | {seconds:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[tuple[str, dict, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for _, s, _ in rows:
        steps = [r["step"] for r in s["evals"]]
        accuracy = [100 * r["test_accuracy"] for r in s["evals"]]
        by_step.plot(steps, accuracy, marker=".", label=s["label"])
        # Step 0 (nothing sent yet) has no place on a log axis.
        sent = [(r["mb_sent"], 100 * r["test_accuracy"]) for r in s["evals"] if r["mb_sent"] > 0]
        by_bytes.plot(*zip(*sent), marker=".", label=s["label"])
    by_step.set(xlabel="step", ylabel="test accuracy (%)", title="accuracy against step")
    by_bytes.set(
        xlabel="MB sent by rank 0 (log scale)",
        ylabel="test accuracy (%)",
        title="accuracy against bytes sent",
        xscale="log",
    )
    for axes in (by_step, by_bytes):
        axes.set_ylim(0, 100)
        axes.grid(alpha=0.3)
    by_step.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", default="runs/compare", help="output directory")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--density", type=float, default=0.01, help="TopK density")
    parser.add_argument("--threshold", type=float, default=1e-2, help="Threshold magnitude")
    parser.add_argument(
        "--runs",
        nargs="+",
        metavar="RUN",
        help="subset of: dense bf16 topk-ef topk-no-ef threshold",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)

    specs = run_specs(args.density, args.threshold)
    names = args.runs or list(specs)
    unknown = [name for name in names if name not in specs]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; choose from {' '.join(specs)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--eval-every",
        str(args.eval_every),
        "--no-progress",
    ]
    rows = []
    for name in names:
        label, flags = specs[name]
        log_json = out / f"{name}.jsonl"
        print(f"{label}: running {args.steps} steps on {args.nproc} ranks ...", flush=True)
        seconds = torchrun(
            args.nproc,
            HERE / "train_digits.py",
            [*flags, *common, "--log-json", str(log_json)],
            out / f"{name}.log",
            args.timeout,
        )
        summary = summarize(read_json_log(log_json))
        summary["label"] = label
        rows.append((name, summary, seconds))
        print(
            f"  test accuracy {100 * summary['final_accuracy']:.2f}%, "
            f"{summary['mb_sent']:.2f} MB sent, {seconds:.0f} s",
            flush=True,
        )

    table = write_table(rows, args, out / "results.md")
    plot(rows, out / "compare.png")
    print()
    print(table)
    print(f"wrote {out / 'results.md'} and {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
