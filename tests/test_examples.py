"""The examples run end to end under torchrun with 2 gloo ranks, and a killed digits run
resumed from its checkpoint ends bitwise where an uninterrupted run ends.

Each torchrun launch costs ~5-15 s on 2 CPU cores (imports, rendezvous), so runs are short.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsecomm

pytest.importorskip(
    "sklearn", reason="the digits example needs scikit-learn: pip install scikit-learn"
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 240


def torchrun(script: str, *flags: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores; also silences torchrun's warning
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(EXAMPLES / script),
        "--no-progress",
        *flags,
    ]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def checksum(result: subprocess.CompletedProcess) -> str:
    found = re.findall(r"param_sha256=([0-9a-f]{64})", result.stdout)
    assert len(found) == 1, f"no checksum in output:\n{result.stdout}\n{result.stderr[-3000:]}"
    return found[0]


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (
        f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    )
    assert "ranks in sync: yes" in result.stdout, result.stdout


def test_digits_reports_accuracy_and_bytes(tmp_path):
    log = tmp_path / "digits.jsonl"
    result = torchrun(
        "train_digits.py",
        "--compressor",
        "topk",
        "--density",
        "0.01",
        "--steps",
        "20",
        "--eval-every",
        "10",
        "--log-json",
        str(log),
    )
    check_ok(result)
    accuracy = float(re.search(r"final test_accuracy=([0-9.]+)", result.stdout).group(1))
    assert 0.0 <= accuracy <= 1.0
    # Both ranks report their bytes and the dense fp32 figure.
    sent = re.findall(
        r"rank (\d): sent ([0-9.]+) MB .* would have sent ([0-9.]+) MB", result.stdout
    )
    assert sorted(rank for rank, _, _ in sent) == ["0", "1"], result.stdout
    for _, mb, dense_mb in sent:
        assert 0 < float(mb) < float(dense_mb) / 10  # TopK(1%) sends far less than fp32
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = [(r["event"], r["step"]) for r in records if r["event"] != "train"]
    assert events == [("config", 0), ("eval", 0), ("eval", 10), ("eval", 20), ("final", 20)]
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 21))
    assert all(b["mb_sent"] > a["mb_sent"] for a, b in zip(train, train[1:]))
    assert records[-1]["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)


def test_charlm_reports_validation_loss(tmp_path):
    log = tmp_path / "charlm.jsonl"
    result = torchrun(
        "train_charlm.py",
        "--compressor",
        "bf16",
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--text-bytes",
        "200000",
        "--val-batches",
        "2",
        "--log-update-rms",
        "--log-json",
        str(log),
    )
    check_ok(result)
    loss = float(re.search(r"final val_loss=([0-9.]+)", result.stdout).group(1))
    assert 0 < loss < 6.0  # below log(256) = 5.55 plus a margin: it learned something or not
    assert re.search(r"rank 1: sent [0-9.]+ MB", result.stdout)
    train = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "train"]
    # AdamW's first step moves every coordinate with a gradient by lr (m_hat / sqrt(v_hat)
    # is its sign), plus weight decay's lr * 0.01 * p: an RMS of at most about 1, above 0
    rms = [r["update_rms"] for r in train]
    assert len(rms) == 6 and 0 < rms[0] <= 1.02 and all(0 < x < 2 for x in rms), rms


def test_update_rms_is_the_step_in_learning_rates():
    common = _common()
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    before = common.parameters_copy(model)
    with torch.no_grad():  # 10 elements: move 4 of them by 0.3, one by -0.6
        model[0].weight[0].add_(0.3)
        model[0].bias[1].add_(0.3)
        model[1].weight[0, 1].sub_(0.6)
    expected = ((4 * 0.3**2 + 0.6**2) / 10) ** 0.5 / 0.1
    assert common.update_rms(model, before, lr=0.1) == pytest.approx(expected, rel=1e-6)
    assert common.update_rms(model, common.parameters_copy(model), lr=0.1) == 0.0


@pytest.mark.parametrize(
    "flags",
    [
        ["--compressor", "topk", "--density", "0.01"],  # SGD momentum + TopK residuals
        [
            "--compressor",
            "threshold",
            "--threshold",
            "1e-2",
            "--optimizer",
            "adamw",
            "--lr",
            "3e-3",
        ],  # AdamW moments + padded Threshold exchange
        # Checkpoint at step 8 in the middle of a 16-step density warm-up, with DGC velocities.
        [
            "--compressor",
            "topk",
            "--density",
            "0.01",
            "--density-warmup",
            "16",
            "--momentum-correction",
        ],
        # Each rank's parameters differ (its unsent updates); the shared ones are compared.
        [
            *("--compressor", "topk", "--density", "0.01", "--optimizer", "adamw"),
            *("--lr", "3e-3", "--exchange", "local_updates"),
        ],
        # Killed between refreshes of the shared second moment (every 5th step).
        [
            *("--compressor", "topk", "--density", "0.01", "--optimizer", "shared-moment-adamw"),
            *("--lr", "3e-3", "--exchange", "local_updates", "--refresh-every", "5"),
        ],
    ],
    ids=["topk-sgd", "threshold-adamw", "topk-warmup-dgc", "topk-local-updates", "shared-moment"],
)
def test_killed_and_resumed_run_matches_uninterrupted_bitwise(tmp_path, flags):
    steps = ["--steps", "24", "--eval-every", "8"]
    uninterrupted = torchrun("train_digits.py", *flags, *steps)
    check_ok(uninterrupted)

    checkpoint = ["--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "8"]
    # Killed (os._exit, no cleanup) after step 13: the last checkpoint is step 8, so the
    # resumed run redoes steps 9..13 and must see the same batches.
    killed = torchrun("train_digits.py", *flags, *steps, *checkpoint, "--stop-after", "13")
    assert killed.returncode != 0, killed.stdout
    assert "--stop-after 13: exiting abruptly" in killed.stdout
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000008"

    resumed = torchrun("train_digits.py", *flags, *steps, *checkpoint, "--resume")
    check_ok(resumed)
    assert "resumed from step 8" in resumed.stdout
    assert checksum(resumed) == checksum(uninterrupted)


def test_digits_runs_without_tqdm_and_without_torchrun(tmp_path):
    """tqdm is optional: with it not installed (an import of it fails) the progress bar is
    skipped, not called. One rank, run as plain ``python``, progress bar on."""
    script = (
        "import runpy, sys\n"
        "sys.modules['tqdm'] = None  # 'import tqdm' now raises ImportError, as if absent\n"
        "sys.modules['tqdm.auto'] = None\n"
        f"sys.path.insert(0, {str(EXAMPLES)!r})\n"
        "sys.argv = ['train_digits.py', '--steps', '2', '--eval-every', '1', '--batch-size', '8']\n"
        f"runpy.run_path({str(EXAMPLES / 'train_digits.py')!r}, run_name='__main__')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    check_ok(result)
    assert "final test_accuracy=" in result.stdout, result.stdout


def _common():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import _common
    finally:
        sys.path.remove(str(EXAMPLES))
    return _common


def test_shard_batch_is_disjoint_and_depends_only_on_seed_and_step():
    common = _common()
    n, batch, world = 101, 8, 3  # 33 examples per rank, 4 batches per epoch, 5 left over
    for step in (0, 3, 4, 11):
        shards = [common.shard_batch(n, step, batch, 7, rank, world) for rank in range(world)]
        assert all(len(s) == batch for s in shards)
        union = set().union(*(set(s.tolist()) for s in shards))
        assert len(union) == world * batch, f"ranks overlap at step {step}: {shards}"
        again = common.shard_batch(n, step, batch, 7, 1, world)
        assert again.equal(shards[1])
    # One epoch on one rank visits distinct examples; the next epoch is another permutation.
    epoch0 = torch.cat([common.shard_batch(n, s, batch, 7, 0, world) for s in range(4)])
    epoch1 = torch.cat([common.shard_batch(n, s, batch, 7, 0, world) for s in range(4, 8)])
    assert len(set(epoch0.tolist())) == 32 and not epoch0.equal(epoch1)
    with pytest.raises(ValueError, match="--batch-size"):
        common.shard_batch(10, 0, 8, 0, 0, 2)


def _saved_at_step_2(common, directory: Path, config: dict) -> None:
    """A checkpoint directory whose latest step (2) holds only its settings."""
    folder = directory / "step-00000002"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"step": 2, "config": config}))
    (directory / common.LATEST).write_text(folder.name)


def test_resume_refuses_other_settings(tmp_path):
    """The settings check runs before anything is loaded, so no process group is needed."""
    common = _common()
    parser = common.make_parser("test")
    saved = parser.parse_args(["--compressor", "topk", "--checkpoint", str(tmp_path)])
    _saved_at_step_2(common, tmp_path, common._config_for_resume(saved, 2))
    now = parser.parse_args(["--compressor", "bf16", "--checkpoint", str(tmp_path), "--resume"])
    with pytest.raises(
        ValueError, match=r"--resume: checkpoint .*'compressor': \('topk', 'bf16'\)"
    ):
        common.load_checkpoint(str(tmp_path), None, None, now, 0, 2)
    with pytest.raises(ValueError, match=r"'world_size': \(2, 4\)"):
        common.load_checkpoint(str(tmp_path), None, None, saved, 0, 4)
    # No checkpoint yet: --resume starts at step 0.
    assert common.load_checkpoint(str(tmp_path / "empty"), None, None, saved, 0, 2) == 0
    # --accumulate changes which micro-batches a step takes: refused too.
    more = parser.parse_args(["--checkpoint", str(tmp_path), "--resume", "--accumulate", "3"])
    with pytest.raises(ValueError, match=r"'accumulate': \(None, 3\)"):
        common.load_checkpoint(str(tmp_path), None, None, more, 0, 2)
    # So do the values' dtype, the warm-up's start, the refresh and the weight decay,
    # which the library would refuse or the saved groups would silently override.
    for flags, key in [
        (["--topk-values", "bf16"], "'topk_values': \\(None, 'bf16'\\)"),
        (["--density-warmup-start", "0.5"], "'density_warmup_start': \\(None, 0.5\\)"),
        (["--refresh-every", "4"], "'refresh_every': \\(None, 4\\)"),
        (["--weight-decay", "0.1"], "'weight_decay': \\(None, 0.1\\)"),
    ]:
        other = parser.parse_args(["--checkpoint", str(tmp_path), "--resume", *flags])
        with pytest.raises(ValueError, match=key):
            common.load_checkpoint(str(tmp_path), None, None, other, 0, 2)


def test_resume_of_a_dense_run_ignores_the_unused_threshold(tmp_path):
    common = _common()
    parser = common.make_parser("test")
    saved = parser.parse_args(["--compressor", "dense", "--checkpoint", str(tmp_path)])
    config = {**common._config_for_resume(saved, 2), "threshold": 0.001}  # as older code saved
    _saved_at_step_2(common, tmp_path, config)
    now = parser.parse_args(
        ["--compressor", "dense", "--checkpoint", str(tmp_path), "--resume", "--threshold", "0.5"]
    )
    with pytest.raises(FileNotFoundError):  # past the settings check: no model.pt here
        common.load_checkpoint(str(tmp_path), torch.nn.Linear(1, 1), None, now, 0, 2)


def run_compare(out: Path, *flags: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "compare.py"), "--out", str(out), *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2 * TIMEOUT_S,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_compare_writes_plot_and_table(tmp_path):
    pytest.importorskip("matplotlib", reason="compare.py plots with matplotlib")
    out = tmp_path / "compare"
    run_compare(out, "--steps", "6", "--eval-every", "3", "--runs", "dense", "topk-ef")
    assert (out / "compare.png").stat().st_size > 10_000
    table = (out / "results.md").read_text()
    assert "| Dense fp32 |" in table and "| TopK(0.01) + EF |" in table
    dense_row = next(line for line in table.splitlines() if line.startswith("| Dense fp32"))
    assert "1.0000 (1/1.0)" in dense_row
    header = next(line for line in table.splitlines() if line.startswith("| run"))
    column = [c.strip() for c in header.split("|")].index("step RMS / lr, last third")
    for row in (line for line in table.splitlines() if line.startswith(("| Dense", "| TopK"))):
        assert float(row.split("|")[column]) > 0, row  # logged by every run


def test_step_rms_averages_the_last_third_of_the_steps():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import compare
    finally:
        sys.path.remove(str(EXAMPLES))
    trains = [{"step": i, "update_rms": float(i)} for i in range(1, 10)]
    assert compare.step_rms(trains) == pytest.approx((7 + 8 + 9) / 3)
    assert compare.step_rms([{"step": 1}]) is None  # a run without --log-update-rms


def test_accumulate_sends_once_per_step_and_keeps_ranks_in_sync():
    flags = ["--compressor", "topk", "--density", "0.01", "--steps", "6", "--eval-every", "6"]
    single = torchrun("train_digits.py", *flags)
    accumulated = torchrun("train_digits.py", *flags, "--accumulate", "3")
    for result in (single, accumulated):
        check_ok(result)
        assert "ranks in sync: yes" in result.stdout, result.stdout
    sent = re.compile(r"rank 0: sent ([0-9.]+) MB over (\d+) steps")
    # TopK sends a fixed k per bucket and step: three micro-batches per step send what one
    # does (the first two backward passes ran inside no_sync and sent nothing).
    assert sent.search(accumulated.stdout).groups() == sent.search(single.stdout).groups()
    assert sent.search(accumulated.stdout).group(2) == "6"
    # ... and they trained on other data (micro-batches 0..17, not 0..5).
    assert checksum(accumulated) != checksum(single)


def test_compare_charlm_writes_its_own_plot_and_table(tmp_path):
    pytest.importorskip("matplotlib", reason="compare.py plots with matplotlib")
    out = tmp_path / "compare"
    run_compare(
        out,
        *("--task", "charlm", "--steps", "4", "--eval-every", "2"),
        *("--density", "0.01", "0.001", "--density-warmup", "2"),
        *("--runs", "dense", "topk-updates-warmup-0.001", "topk-catchup-adam-warmup-0.001"),
    )
    assert (out / "charlm.png").stat().st_size > 10_000
    assert not (out / "results.md").exists()  # the digits table is left alone
    table = (out / "charlm.md").read_text()
    assert "val bits per byte" in table and "AdamW" in table
    row = next(line for line in table.splitlines() if line.startswith("| TopK(0.001)"))
    assert "updates, exp. warm-up 2 (d+b)" in row
    log = (out / "charlm-topk-updates-warmup-0.001.jsonl").read_text().splitlines()
    config = next(json.loads(line) for line in log if '"config"' in line)
    assert config["exchange"] == "updates" and config["density_warmup"] == 2
    assert "warmup_steps=2" in config["compressor"]
    log = (out / "charlm-topk-catchup-adam-warmup-0.001.jsonl").read_text().splitlines()
    config = next(json.loads(line) for line in log if '"config"' in line)
    assert "select='adam'" in config["compressor"] and config["optimizer"] == "catchup-adamw"


def test_compare_passes_script_args_and_names_its_outputs(tmp_path):
    out = tmp_path / "compare"
    run_compare(
        out,
        *("--task", "charlm", "--nproc", "1", "--steps", "2", "--eval-every", "2"),
        *("--name", "tiny", "--script-args=--width 16 --layers 1 --heads 2 --context 8"),
        *("--runs", "dense", "topk-ef"),
    )
    run_compare(  # without a dense run: no gap to report, bytes still against dense fp32's
        out,
        *("--task", "charlm", "--nproc", "1", "--steps", "2", "--eval-every", "2"),
        *("--name", "alone", "--script-args=--width 16 --layers 1 --heads 2 --context 8"),
        *("--runs", "topk-ef"),
    )
    alone = next(line for line in (out / "alone.md").read_text().splitlines() if "TopK" in line)
    assert "| n/a |" in alone and "(1/1.0)" not in alone
    assert not (out / "charlm.md").exists()  # the default comparison is left alone
    table = (out / "tiny.md").read_text()
    assert "1 ranks" in table and "--width 16 --layers 1 --heads 2 --context 8" in table
    topk_row = next(line for line in table.splitlines() if line.startswith("| TopK"))
    assert "(1/1.0)" not in topk_row  # its bytes against dense fp32's, not its own
    log = (out / "tiny-topk-ef.jsonl").read_text().splitlines()
    config = next(json.loads(line) for line in log if '"config"' in line)
    assert (config["width"], config["context"], config["world_size"]) == (16, 8, 1)
    assert "TopK" in config["compressor"]


@pytest.mark.parametrize("flag", ["--lr 1", "--optimizer=sgd", "--density 0.5", "--dens 0.5"])
def test_compare_refuses_script_args_it_sets_itself(tmp_path, flag):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "compare.py"), "--task", "charlm"]
        + ["--out", str(tmp_path), f"--script-args={flag}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--script-args: compare.py sets --" in result.stderr
    assert not list(tmp_path.iterdir())  # refused before any run


def test_select_adam_needs_an_adam_optimizer_and_gradients():
    common = _common()
    parser = common.make_parser("test")
    for flags in (["--optimizer", "sgd"], ["--optimizer", "adamw", "--exchange", "updates"]):
        args = parser.parse_args(["--select", "adam", *flags])
        with pytest.raises(SystemExit):
            common.check_args(parser, args)
    common.check_args(parser, parser.parse_args(["--select", "adam", "--optimizer", "adamw"]))


@pytest.mark.parametrize(
    "flags",
    [
        ["--select", "adam", "--optimizer", "adamw", "--compressor", "dense"],
        ["--density-warmup", "5", "--density-warmup-start", "0"],
        ["--density-warmup", "5", "--density-warmup-start", "-1"],
        ["--optimizer", "adamw", "--exchange", "updates", "--refresh-every", "5"],
        ["--optimizer", "shared-moment-adamw", "--exchange", "updates", "--refresh-every", "0"],
        ["--compressor", "threshold", "--topk-values", "bf16"],
        ["--compressor", "dense", "--density-warmup", "10"],
    ],
)
def test_flags_that_would_do_nothing_are_refused(flags):
    common = _common()
    parser = common.make_parser("test")
    with pytest.raises(SystemExit):
        common.check_args(parser, parser.parse_args(flags))


def test_topk_values_flag_builds_the_compressor():
    common = _common()
    parser = common.make_parser("test")
    args = parser.parse_args(["--compressor", "topk", "--topk-values", "bf16"])
    common.check_args(parser, args)
    assert common.make_compressor(args).value_dtype == torch.bfloat16
    args = parser.parse_args(["--compressor", "topk"])
    assert common.make_compressor(args).value_dtype == torch.float32


def test_refresh_every_defaults_to_the_optimizers_own():
    common = _common()
    parser = common.make_parser("test")
    args = parser.parse_args(["--optimizer", "shared-moment-adamw", "--exchange", "updates"])
    common.check_args(parser, args)
    optimizer = common.make_optimizer(args, torch.nn.Linear(3, 2))
    default = inspect.signature(sparsecomm.SharedMomentAdamW).parameters["refresh_every"].default
    assert optimizer.optimizer.refresh_every == default
