"""Compare compressors on an example: its metric against step and against bytes sent.

``--task digits`` (default) runs ``train_digits.py`` (SGD momentum) for dense fp32,
Cast(bf16), TopK with and without error feedback, TopK with a density warm-up, TopK with
DGC momentum correction and Threshold. ``--task charlm`` runs ``train_charlm.py`` (AdamW)
for dense fp32 and the AdamW recipes: TopK into AdamW as it is, with the exponential density
warm-up, with a dense warm-up, with ``exchange="updates"`` (and ``"local_updates"``, with
either warm-up, and with ``SharedMomentAdamW`` in place of AdamW), with ``CatchUpAdamW`` in
place of AdamW (each alone and with either warm-up), and with ``TopK(select="adam")`` (the
choice in Adam's units) under the exponential warm-up, with AdamW and CatchUpAdamW.
Each TopK run is repeated for every ``--density``. All runs use torchrun (2 ranks by
default) with the same seed and flags, and write to the output directory (default
``runs/compare/``):

- ``compare.png`` / ``charlm.png``: the metric against step and against megabytes sent
  (rank 0);
- ``results.md`` / ``charlm.md``: the measured table (final metric, MB sent, ratio to
  dense, and how far a step moved the model: the mean ``update_rms`` of the last third of
  the steps, from the examples' ``--log-update-rms``);
- ``<run>.jsonl`` and ``<run>.log`` (``charlm-<run>.*`` for charlm): each run's metrics and
  output.

``--script-args`` passes flags of the example to every run (a larger model, say), and
``--name`` names the outputs (``<name>.md``, ``<name>.png``, ``<name>-<run>.*``) so that
such a comparison does not overwrite the default one. With CUDA, each rank takes a GPU.

    python examples/compare.py                                 # digits, ~2 minutes
    python examples/compare.py --steps 100 --runs dense topk-ef topk-no-ef
    python examples/compare.py --task charlm --density 0.01 0.001   # ~5 minutes
    python examples/compare.py --task charlm --nproc 1 --name charlm-gpu \
        --script-args="--width 512 --layers 6 --heads 8 --context 128"  # one GPU
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import read_json_log  # noqa: E402

TASKS = {
    # task: (script, metric key, metric label, higher is better, output prefix)
    "digits": ("train_digits.py", "test_accuracy", "test accuracy (%)", True, ""),
    "charlm": (
        "train_charlm.py",
        "val_bits_per_byte",
        "validation bits per byte",
        False,
        "charlm-",
    ),
}


def run_specs(
    task: str, densities: list[float], threshold: float, warmup: int
) -> dict[str, tuple[str, list[str]]]:
    """``{run name: (label, flags)}``, in the order they are run and plotted."""
    specs = {"dense": ("Dense fp32", ["--compressor", "dense"])}
    if task == "digits":
        specs["bf16"] = ("Cast(bf16)", ["--compressor", "bf16"])
    many = len(densities) > 1
    exp = ["--density-warmup", str(warmup)]
    dense = [*exp, "--density-warmup-shape", "dense"]
    catchup = ["--optimizer", "catchup-adamw"]
    adam = ["--select", "adam"]  # TopK(select="adam")
    if task == "digits":
        variants = [
            ("topk-ef", "+ EF", []),
            ("topk-no-ef", "no EF", ["--no-error-feedback"]),
            ("topk-warmup", f"+ EF, exp. warm-up {warmup}", exp),
            (
                "topk-dgc",
                f"+ EF, warm-up {warmup}, momentum corr.",
                [*exp, "--momentum-correction"],
            ),
        ]
    else:
        variants = [
            ("topk-ef", "+ EF (a: as is)", []),
            ("topk-warmup", f"+ EF, exp. warm-up {warmup} (b)", exp),
            ("topk-dense-warmup", f"+ EF, dense warm-up {warmup} (c)", dense),
            ("topk-updates", "+ EF, updates (d)", ["--exchange", "updates"]),
            (
                "topk-updates-warmup",
                f"+ EF, updates, exp. warm-up {warmup} (d+b)",
                ["--exchange", "updates", *exp],
            ),
            (
                "topk-updates-dense-warmup",
                f"+ EF, updates, dense warm-up {warmup} (d+c)",
                ["--exchange", "updates", *dense],
            ),
            (
                "topk-local-warmup",
                f"+ EF, local updates, exp. warm-up {warmup} (l+b)",
                ["--exchange", "local_updates", *exp],
            ),
            (
                "topk-local-dense-warmup",
                f"+ EF, local updates, dense warm-up {warmup} (l+c)",
                ["--exchange", "local_updates", *dense],
            ),
            (
                "topk-local-shared-warmup",
                f"+ EF, local updates, SharedMomentAdamW, exp. warm-up {warmup} (l+b+v)",
                ["--exchange", "local_updates", "--optimizer", "shared-moment-adamw", *exp],
            ),
            ("topk-catchup", "+ EF, CatchUpAdamW (e)", catchup),
            (
                "topk-catchup-warmup",
                f"+ EF, CatchUpAdamW, exp. warm-up {warmup} (e+b)",
                [*catchup, *exp],
            ),
            (
                "topk-catchup-dense-warmup",
                f"+ EF, CatchUpAdamW, dense warm-up {warmup} (e+c)",
                [*catchup, *dense],
            ),
            (
                "topk-adam-warmup",
                f"+ EF, Adam-scaled choice, exp. warm-up {warmup} (b+s)",
                [*exp, *adam],
            ),
            (
                "topk-catchup-adam-warmup",
                f"+ EF, CatchUpAdamW, Adam-scaled choice, exp. warm-up {warmup} (e+b+s)",
                [*catchup, *exp, *adam],
            ),
        ]
    for density in densities:
        for name, what, flags in variants:
            key = f"{name}-{density:g}" if many else name
            specs[key] = (
                f"TopK({density:g}) {what}",
                ["--compressor", "topk", "--density", str(density), *flags],
            )
    if task == "digits":
        specs["threshold"] = (
            f"Threshold({threshold:g}) + EF",
            ["--compressor", "threshold", "--threshold", str(threshold)],
        )
    return specs


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


def summarize(records: list[dict], metric: str = "test_accuracy") -> dict:
    evals = [r for r in records if r["event"] == "eval"]
    trains = [r for r in records if r["event"] == "train"]
    final = next(r for r in records if r["event"] == "final")
    last = [r[metric] for r in evals[-3:]]
    return {
        "metric": metric,
        "final": final[metric],
        "last3": sum(last) / len(last),
        "mb_sent": final["mb_sent"],
        "dense_mb": final["dense_mb"],
        "mean_density": sum(r["density"] for r in trains) / len(trains),
        "step_rms": step_rms(trains),
        "evals": evals,
    }


def step_rms(trains: list[dict]) -> float | None:
    """Mean ``update_rms`` (``--log-update-rms``: a step's parameter change, root mean square
    over the learning rate) over the last third of the steps; None if it was not logged."""
    logged = [r["update_rms"] for r in trains if "update_rms" in r]
    if not logged:
        return None
    tail = logged[len(logged) * 2 // 3 :]
    return sum(tail) / len(tail)


def _backend() -> str:
    """Where the runs ran: the examples take NCCL and a GPU per rank when CUDA is there."""
    import torch

    return "NCCL, GPU" if torch.cuda.is_available() else "gloo, CPU"


def _value(task: str, value: float) -> str:
    return f"{100 * value:.2f}%" if task == "digits" else f"{value:.4f}"


def write_table(rows: list[tuple[str, dict, float]], args, path: Path) -> str:
    dense = next((s for name, s, _ in rows if name == "dense"), None)
    flags = f" {args.script_args}," if args.script_args else ""
    if args.task == "digits":
        head = (
            f"digits CNN, {args.nproc} ranks ({_backend()}), SGD momentum 0.9, lr {args.lr:g},"
            f"{flags} {args.steps} steps of {args.batch_size} per rank, seed {args.seed}."
        )
        metric = "test acc"
    else:
        head = (
            f"byte-level transformer LM, {args.nproc} ranks ({_backend()}), AdamW, lr "
            f"{args.lr:g},{flags} train_charlm.py defaults otherwise, {args.steps} steps, "
            f"seed {args.seed}."
        )
        metric = "val bits per byte"
    lines = [
        f"{head} MB sent: rank 0's payload into the collectives (StepStats.bytes_sent).",
        "",
        f"| run | final {metric} | vs dense | mean of last 3 evals | MB sent | ratio to dense | "
        "mean density | step RMS / lr, last third | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, s, seconds in rows:
        # bytes against what dense fp32 would have sent (each run counts it); the metric
        # against the dense run's, if it is among the rows
        ratio = s["mb_sent"] / s["dense_mb"] if s["dense_mb"] else float("nan")
        if dense is None:
            gap = "n/a"
        else:
            gap = s["final"] - dense["final"]
            gap = f"{100 * gap:+.2f}" if args.task == "digits" else f"{gap:+.4f}"
        rms = "n/a" if s.get("step_rms") is None else f"{s['step_rms']:.3f}"
        lines.append(
            f"| {s['label']} | {_value(args.task, s['final'])} | {gap} | "
            f"{_value(args.task, s['last3'])} | {s['mb_sent']:.2f} | {ratio:.4f} "
            f"(1/{1 / ratio:.1f}) | {100 * s['mean_density']:.2f}% | {rms} | {seconds:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(rows: list[tuple[str, dict, float]], path: Path, task: str = "digits") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, _, ylabel, higher_better, _ = TASKS[task]
    scale = 100 if task == "digits" else 1
    figure, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(13, 5.5))

    # One colour per recipe, one line style per density: ten colours would repeat otherwise.
    # tab20's dark shades first (tab10's colours), then its light ones: 20 before a repeat.
    def colour(index: int):
        return plt.cm.tab20((2 * index + index // 10) % 20)

    variants: list[str] = []
    for _, s, _ in rows:
        if s.get("variant", s["label"]) not in variants:
            variants.append(s.get("variant", s["label"]))
    for _, s, _ in rows:
        metric = s["metric"]
        style = {
            "color": colour(variants.index(s.get("variant", s["label"]))),
            "linestyle": ("-", "--", ":", "-.")[s.get("density_index", 0) % 4],
            "marker": ".",
            "label": s["label"],
        }
        steps = [r["step"] for r in s["evals"]]
        values = [scale * r[metric] for r in s["evals"]]
        by_step.plot(steps, values, **style)
        # Step 0 (nothing sent yet) has no place on a log axis.
        sent = [(r["mb_sent"], scale * r[metric]) for r in s["evals"] if r["mb_sent"] > 0]
        by_bytes.plot(*zip(*sent), **style)
    name = ylabel.split(" (")[0]
    by_step.set(xlabel="step", ylabel=ylabel, title=f"{name} against step")
    by_bytes.set(
        xlabel="MB sent by rank 0 (log scale)",
        ylabel=ylabel,
        title=f"{name} against bytes sent",
        xscale="log",
    )
    for axes in (by_step, by_bytes):
        if task == "digits":
            axes.set_ylim(0, 100)
        else:  # the untrained model's 8 bits per byte would flatten the curves
            finals = [s["final"] for _, s, _ in rows]
            axes.set_ylim(min(finals) - 0.1, max(finals) + 1.0)
        axes.grid(alpha=0.3)
    if len(rows) <= 10:
        by_step.legend(loc="lower right" if higher_better else "upper right", fontsize="small")
        figure.tight_layout()
    else:  # more rows than fit over the curves: the legend goes below both plots
        figure.set_size_inches(13, 5.5 + 0.2 * len(rows) / 2)
        share = 0.2 * len(rows) / 2 / figure.get_size_inches()[1] + 0.03
        handles, labels = by_step.get_legend_handles_labels()
        figure.legend(handles, labels, loc="lower center", ncol=2, fontsize="small")
        figure.tight_layout(rect=(0, share, 1, 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_if_possible(rows: list[tuple[str, dict, float]], path: Path, task: str) -> bool:
    """:func:`plot`, or a note once if matplotlib is not installed (the table and the
    logs are written either way)."""
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        if len(rows) == 1:
            print("  (no plot: matplotlib is not installed; pip install matplotlib)", flush=True)
        return False
    plot(rows, path, task)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--task", choices=tuple(TASKS), default="digits")
    parser.add_argument("--out", default="runs/compare", help="output directory")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--batch-size", type=int, help="per rank (default: digits 32, charlm its own 16)"
    )
    parser.add_argument("--lr", type=float, help="default: digits 0.05, charlm its own 3e-3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument(
        "--density", type=float, nargs="+", default=[0.01], help="TopK densities, one set each"
    )
    parser.add_argument(
        "--density-warmup", type=int, default=100, help="steps of the warm-up runs' warm-up"
    )
    parser.add_argument("--threshold", type=float, default=1e-2, help="Threshold magnitude")
    parser.add_argument("--runs", nargs="+", metavar="RUN", help="a subset of the runs")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument(
        "--script-args",
        default="",
        help="flags of the example for every run, e.g. --script-args='--width 512 --layers 6' "
        "(write it with '=': the value starts with a dash)",
    )
    parser.add_argument(
        "--name",
        help="outputs NAME.md, NAME.png, NAME-<run>.* (default: results.md, compare.png and "
        "<run>.* for digits; charlm.md, charlm.png and charlm-<run>.* for charlm)",
    )
    args = parser.parse_args(argv)
    script_args = shlex.split(args.script_args)
    # Set by compare.py: from its own flags, or by each run's recipe.
    taken = {"--steps", "--batch-size", "--lr", "--seed", "--eval-every", "--log-json"}
    taken |= {"--compressor", "--density", "--density-warmup", "--density-warmup-shape"}
    taken |= {"--exchange", "--optimizer", "--select", "--threshold", "--no-error-feedback"}
    taken |= {"--momentum-correction", "--no-progress", "--log-update-rms"}
    # (argparse takes a flag's unambiguous prefix too: "--dens" is --density)
    given = [a.split("=")[0] for a in script_args if a.startswith("--")]
    clash = sorted({flag for flag in taken for key in given if flag.startswith(key)})
    if clash:
        parser.error(
            f"--script-args: compare.py sets {' '.join(clash)} itself (its own flags, or "
            "each run's recipe)"
        )
    if args.batch_size is None:
        args.batch_size = 32 if args.task == "digits" else 16
    if args.lr is None:
        args.lr = 0.05 if args.task == "digits" else 3e-3

    script, metric, _, _, prefix = TASKS[args.task]
    if args.name:
        prefix = f"{args.name}-"
    specs = run_specs(args.task, args.density, args.threshold, args.density_warmup)
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
        "--log-update-rms",
        *script_args,
    ]
    if args.name:
        table_path, out_name = out / f"{args.name}.md", out / f"{args.name}.png"
    else:
        table_path = out / ("results.md" if args.task == "digits" else "charlm.md")
        out_name = out / ("compare.png" if args.task == "digits" else "charlm.png")
    rows = []
    for name in names:
        label, flags = specs[name]
        log_json = out / f"{prefix}{name}.jsonl"
        print(f"{label}: running {args.steps} steps on {args.nproc} ranks ...", flush=True)
        seconds = torchrun(
            args.nproc,
            HERE / script,
            [*flags, *common, "--log-json", str(log_json)],
            out / f"{prefix}{name}.log",
            args.timeout,
        )
        summary = summarize(read_json_log(log_json), metric)
        summary["label"] = label
        summary["variant"], summary["density_index"] = name, 0
        for index, density in enumerate(args.density):
            if len(args.density) > 1 and name.endswith(f"-{density:g}"):
                summary["variant"], summary["density_index"] = name[: -len(f"-{density:g}")], index
        rows.append((name, summary, seconds))
        print(
            f"  {metric} {_value(args.task, summary['final'])}, "
            f"{summary['mb_sent']:.2f} MB sent, {seconds:.0f} s",
            flush=True,
        )
        table = write_table(rows, args, table_path)  # after each run: a timeout keeps them
        plotted = _plot_if_possible(rows, out_name, args.task)
    print()
    print(table)
    print(f"wrote {table_path}" + (f" and {out_name}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
