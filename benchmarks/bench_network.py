"""Wall-clock training-step time of sparsecomm against DistributedDataParallel over a shaped link.

    python benchmarks/bench_network.py --rates unshaped,1gbit,300mbit --out docs/network

For each rate it starts a private network namespace (``unshare --net --pid --fork``), brings
its loopback up, shapes it with ``tc qdisc add dev lo root tbf rate R burst B latency L``
(``--delay D`` puts ``netem delay D`` in front), and runs ``benchmarks/_network_worker.py``
under ``torchrun`` on W ranks there (gloo on CPU; NCCL where GPUs are, forced onto sockets
with ``NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1`` so that the shaped loopback carries it). The
worker first measures the link: it times an all-reduce sized to take about a second at the set
rate and reports the bandwidth it achieved beside the set one. A ring all-reduce of ``S`` bytes
moves ``2 (W-1)/W * S`` bytes per rank.

Loopback is one shared medium: every byte any rank sends goes through the one shaped queue of
``lo``. The set rate is therefore the total of all ranks, not each rank's: an all-reduce puts
``W * 2 (W-1)/W * S = 2 (W-1) * S`` bytes through it, and each rank gets about ``rate / W``.
Two ranks on ``300mbit`` see what two machines with a 150 Mbit/s link each would see. The
report gives both figures; the planner check passes ``rate / W`` (measured) as the per-rank
bandwidth.

Then each row (``--rows``), the same model from the same seed on the same data:

- ``none``: no exchange, each rank steps its own AdamW: the compute floor;
- ``ddp``, ``ddp+fp16``, ``ddp+bf16``, ``ddp+powersgd``: ``DistributedDataParallel`` in fp32,
  with torch's ``fp16_compress_hook``, ``bf16_compress_hook`` (where the build allows it: NCCL
  on CUDA) and ``powerSGD_hook`` (rank ``--powersgd-rank``, compressing from the third step;
  on gloo only for a model that fits one DDP bucket, see the worker);
- ``Dense()``, ``Cast(bf16)``, ``Threshold(t)``, ``TopK(0.01)``, ``TopK(0.001)``: sparsecomm's
  ``CompressedOptimizer`` around AdamW. ``t`` is calibrated once, at the first rate: bisected
  so that error-feedback thresholding of the initial model's gradients on the first
  warm-up + timed steps' data sends ``--threshold-density`` (1%) of the elements
  (``--threshold`` sets it instead);
- ``TopK(0.01)/local_updates``, ``TopK(0.01)/updates`` (any sparsecomm row, then ``/``):
  the same with ``exchange="local_updates"`` or ``"updates"`` (each rank's AdamW step is what
  is compressed and sent: the AdamW recipes of docs/adamw.md; the planner check leaves these
  rows out);
- ``ddp+sc-TopK(0.01)``: DDP with ``sparsecomm.ddp_comm_hook(sparsecomm.TopK(0.01))``, where
  that function exists.

A row that cannot run says why and is skipped. The model is examples/train_charlm.py's
``CharTransformer`` (default width 384, 8 layers, 6 heads, context 64: 14.4M parameters),
AdamW, on the standard-library text that example reads (``--batch-size`` windows of
``--context`` bytes per rank per step). Figures per row and rate: median and
p20-p80 of the step time (forward + backward + optimizer step; per step the slowest rank), the
bytes each rank puts into the collectives per step, the compress / communicate / aggregate
shares (sparsecomm rows, from ``--profile-steps`` extra steps with ``profile=True``), and with
``--target-loss`` the seconds and steps to reach a validation loss.

Writes ``table.md``, ``network.png`` (median step time against link rate, log x), and
``results.json`` (every number) into ``--out``, each launch's log and tc counters into
``--out/launches/``; ``--from-json`` rewrites the report from a ``results.json``.
``--sparsecomm-path DIR`` makes the workers import another copy of sparsecomm (an exported
older commit, say) than this checkout's. Every launch is bounded: steps are fixed, and a
rate that runs past ``--rate-timeout`` seconds has every process of its namespace killed.

Needs Linux, root, ``unshare`` (util-linux) and ``ip``/``tc`` (iproute2); without them it exits
with one line saying what is missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "_network_worker.py"

DEFAULT_RATES = "unshaped,1gbit,300mbit"
DEFAULT_ROWS = (
    "none,ddp,ddp+fp16,ddp+bf16,ddp+powersgd,Dense(),Cast(bf16),Threshold(t),TopK(0.01),"
    "TopK(0.001),ddp+sc-TopK(0.01)"
)
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


# --------------------------------------------------------------------------- flags


_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_ROW_FORMS = [
    (re.compile(r"^none$", re.I), lambda m: "none"),
    (re.compile(r"^ddp$", re.I), lambda m: "ddp"),
    (re.compile(r"^ddp\+fp16$", re.I), lambda m: "ddp+fp16"),
    (re.compile(r"^ddp\+bf16$", re.I), lambda m: "ddp+bf16"),
    (re.compile(r"^ddp\+powersgd$", re.I), lambda m: "ddp+powersgd"),
    (re.compile(r"^dense(\(\))?$", re.I), lambda m: "Dense()"),
    (re.compile(r"^(cast\((torch\.)?(bfloat16|bf16)\)|bf16)$", re.I), lambda m: "Cast(bf16)"),
    (re.compile(r"^(cast\((torch\.)?(float16|fp16)\)|fp16)$", re.I), lambda m: "Cast(fp16)"),
    (re.compile(r"^threshold(\(t\))?$", re.I), lambda m: "Threshold(t)"),
    (
        re.compile(rf"^threshold\({_NUMBER}\)$", re.I),
        lambda m: f"Threshold({float(m[1]):g})",
    ),
    (re.compile(rf"^topk\({_NUMBER}\)$", re.I), lambda m: f"TopK({float(m[1]):g})"),
    (
        re.compile(rf"^ddp\+sc-topk\({_NUMBER}\)$", re.I),
        lambda m: f"ddp+sc-TopK({float(m[1]):g})",
    ),
]


# What a sparsecomm row may add after a "/": CompressedOptimizer's exchange= other than the
# default gradient exchange (the AdamW recipes of docs/adamw.md exchange updates).
EXCHANGES = ("updates", "local_updates")


def split_cap(name: str) -> tuple[str, float | None]:
    """``("TopK(0.01)", 25.0)`` from the row ``TopK(0.01)@25``: the row without its bucket
    cap, and the cap in MiB (None: ``--bucket-cap-mb``'s)."""
    base, at, cap = name.partition("@")
    return base, (float(cap) if at else None)


def parse_rows(text: str) -> list[str]:
    """Canonical row names from a comma-separated list (``dense`` or ``Dense()``,
    ``bf16`` or ``Cast(torch.bfloat16)``, ``TopK(0.01)``, ``TopK(0.01)/local_updates``, ...),
    in the order given. A row of DDP or sparsecomm may end in ``@C``: its own bucket cap of
    C MiB (``TopK(0.01)@25``), so that two bucket sizes run side by side."""
    rows = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        item, at, cap = item.partition("@")
        if at:
            try:
                cap_mb = float(cap)
            except ValueError:
                cap_mb = 0.0
            if not cap_mb > 0 or item.strip() == "none":
                raise ValueError(
                    f"row {item}@{cap}: after an '@' a DDP or sparsecomm row takes its bucket "
                    "cap in MiB, a number > 0; e.g. TopK(0.01)@25"
                )
            cap = f"@{cap_mb:g}"
        item, _, exchange = item.partition("/")
        for pattern, canonical in _ROW_FORMS:
            match = pattern.match(item.replace(" ", ""))
            if match:
                name = canonical(match)
                break
        else:
            raise ValueError(
                f"row {item!r} is not known; rows are none, ddp, ddp+fp16, ddp+bf16, "
                "ddp+powersgd, Dense(), Cast(bf16), Cast(fp16), Threshold(t) or Threshold(T), "
                "TopK(D), ddp+sc-TopK(D)"
            )
        for prefix in ("TopK(", "ddp+sc-TopK("):
            if name.startswith(prefix) and not 0 < float(name[len(prefix) : -1]) <= 1:
                raise ValueError(f"row {item!r}: the density must be in (0, 1], e.g. TopK(0.01)")
        if exchange:
            exchange = exchange.strip().lower().replace("-", "_")
            if name == "none" or name.startswith("ddp") or exchange not in EXCHANGES:
                raise ValueError(
                    f"row {item}/{exchange}: after a '/' a sparsecomm row (Dense(), Cast, "
                    f"Threshold, TopK) takes its exchange, one of {', '.join(EXCHANGES)}; "
                    "e.g. TopK(0.01)/local_updates"
                )
            name = f"{name}/{exchange}"
        name += cap
        if name not in rows:
            rows.append(name)
    if not rows:
        raise ValueError("--rows is empty; e.g. --rows none,ddp,TopK(0.01)")
    return rows


_RATE_RE = re.compile(r"^([0-9]*\.?[0-9]+)(k|m|g|t)?bit$", re.I)
_RATE_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> tuple[str, float]:
    """``("300mbit", 3.75e7)``: tc's rate spelling and bytes per second (0 for ``unshaped``).
    Only bit rates (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, decimal prefixes as tc
    reads them); tc's ``bps`` means bytes/s, an easy factor of 8 to get wrong, so it is refused."""
    label = text.strip().lower()
    if label in ("unshaped", "none", "inf"):
        return "unshaped", 0.0
    match = _RATE_RE.match(label)
    if not match:
        raise ValueError(
            f"rate {text!r} is not understood; write unshaped or a bit rate such as 10gbit, "
            "1gbit, 300mbit"
        )
    value = float(match[1]) * _RATE_SCALE[(match[2] or "").lower()] / 8
    if not value > 0:
        raise ValueError(f"rate {text!r} must be > 0")
    return label, value


_TIME_RE = re.compile(r"^([0-9]*\.?[0-9]+)(us|ms|s)$")


def parse_tc_time(text: str, flag: str) -> str:
    if not _TIME_RE.match(text.strip()):
        raise ValueError(f"{flag} {text!r} is not understood; write e.g. 500us, 1ms, 0.1s")
    return text.strip()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--rates", default=DEFAULT_RATES, help="comma-separated: unshaped, 10gbit, 300mbit, ...")
    add("--rows", default=DEFAULT_ROWS, help="comma-separated rows, in order")
    add("--world-size", type=int, default=2, help="ranks W (torchrun --nproc_per_node)")
    add("--out", default="bench_network_out", help="directory for table.md, network.png, json")
    add("--delay", default=None, help="netem delay on lo, e.g. 1ms (each packet; RTT gains 2x)")
    add("--burst", default=None, help="tbf burst (bytes); default max(256 KiB, 2 ms of rate)")
    add("--tbf-latency", default="100ms", help="tbf latency (bounds its queue)")
    add("--width", type=int, default=384)
    add("--layers", type=int, default=8)
    add("--heads", type=int, default=6)
    add("--context", type=int, default=64)
    add("--batch-size", type=int, default=4, help="windows per rank per step")
    add("--text-bytes", type=int, default=1_000_000)
    add("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    add(
        "--adamw",
        choices=("default", "fused"),
        default="default",
        help="every row's AdamW: torch's default implementation (on a CPU a loop over the "
        "tensors) or fused=True (one fused kernel; on a CPU its time does not depend on the "
        "data, where the default's sqrt of zero second moments, which sparse averaged "
        "gradients leave, is several times slower than of positive ones)",
    )
    add("--lr-warmup", type=int, default=20, help="linear warm-up steps of the learning rate")
    add("--seed", type=int, default=0)
    add("--steps", type=int, default=6, help="timed steps per row and round")
    add(
        "--rounds",
        type=int,
        default=1,
        help="times the rows run at each rate, taking turns (every other round in reverse "
        "order): drift of the machine spreads over every row instead of favouring some",
    )
    add(
        "--interleave",
        action="store_true",
        help="build every row once at each rate, then take turns of --steps steps for "
        "--rounds rounds (no rebuild between turns): the report adds each row's ratio to "
        "the baselines turn by turn, which the machine's drift over minutes does not move",
    )
    add("--warmup", type=int, default=2, help="untimed steps per row first")
    add("--profile-steps", type=int, default=2, help="sparsecomm rows: profile=True steps")
    add("--threshold", type=float, default=None, help="t of Threshold(t); default: calibrated")
    add("--threshold-density", type=float, default=0.01, help="what the calibrated t aims at")
    parser.set_defaults(threshold_how=None)  # set after the first rate calibrates t
    add("--powersgd-rank", type=int, default=4, help="PowerSGD matrix_approximation_rank")
    add(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's and sparsecomm's bucket size (default: DDP's 25 MiB; sparsecomm's own "
        "default for its compressor, 100 MiB for TopK and Threshold)",
    )
    add("--target-loss", type=float, default=None, help="report seconds/steps to this val loss")
    add("--target-max-steps", type=int, default=300)
    add("--target-max-seconds", type=float, default=120.0)
    add("--eval-every", type=int, default=10, help="steps between validations (target runs)")
    add("--link-seconds", type=float, default=1.0, help="the link measurement aims at this")
    add("--rate-timeout", type=float, default=600.0, help="seconds per rate before killing it")
    add(
        "--sparsecomm-path",
        default=None,
        metavar="DIR",
        help="the workers import sparsecomm from DIR (a directory holding sparsecomm/ with "
        "triton_kernels/ inside it, e.g. an exported older commit) instead of this checkout",
    )
    add(
        "--from-json",
        default=None,
        metavar="RESULTS_JSON",
        help="measure nothing: rewrite table.md, network.png and the planner check into --out "
        "from a results.json of an earlier run",
    )
    add("--note", default=None, help="a line for the report's and the plot's title")
    add(
        "--planner-overlap",
        type=float,
        default=None,
        help="overlap fraction the planner check gives sparsecomm.plan (default: fitted to "
        "the run's Dense() and Cast rows; 0: an exchange after backward)",
    )
    return parser


# --------------------------------------------------------------------------- prerequisites


def find_tool(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN)
    return shutil.which(name, path=path)


def missing_prerequisite(delay: bool = False) -> str | None:
    """None when this machine can shape a private loopback, else one line saying what is
    missing and how to get it."""
    if not sys.platform.startswith("linux"):
        return f"bench_network needs Linux (network namespaces and tc), not {sys.platform}"
    if os.geteuid() != 0:
        return (
            "bench_network needs root: a network namespace (unshare -n) and tc qdisc need "
            "CAP_SYS_ADMIN and CAP_NET_ADMIN; run it as root (sudo -E "
            f"{Path(sys.executable).name} benchmarks/bench_network.py ...)"
        )
    for tool, package in (("unshare", "util-linux"), ("ip", "iproute2"), ("tc", "iproute2")):
        if find_tool(tool) is None:
            return (
                f"bench_network needs `{tool}`, which is not installed: apt-get install {package}"
            )
    probes = [
        ("tbf rate 1gbit burst 262144 latency 100ms", "sch_tbf", ""),
    ]
    if delay:
        probes.append(("netem delay 1ms", "sch_netem", " (for --delay; run without it)"))
    for qdisc, module, note in probes:
        script = f"ip link set lo up && tc qdisc add dev lo root {qdisc}"
        try:
            probe = subprocess.run(
                [
                    find_tool("unshare"),
                    "--net",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "sh",
                    "-c",
                    script,
                ],
                capture_output=True,
                text=True,
                timeout=30,
                env=_tool_env(),
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"bench_network could not start `unshare --net --pid --fork`: {error}"
        if probe.returncode != 0:
            why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
            return (
                f"bench_network could not shape a private loopback with `tc qdisc add dev lo "
                f"root {qdisc}` ({why}): this kernel lacks network namespaces or the {module} "
                f"qdisc{note} (modprobe {module}; `unshare --kill-child` needs util-linux >= "
                "2.32: apt-get install util-linux iproute2)"
            )
    return None


def _tool_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + os.pathsep + os.pathsep.join(_SBIN)
    return env


# --------------------------------------------------------------------------- one rate


def qdisc_commands(label: str, rate_bytes_per_s: float, args: argparse.Namespace) -> list[str]:
    """tc commands for one rate (run inside the namespace). ``label`` is the rate as tc reads
    it (``300mbit``: decimal prefixes, bits)."""
    commands = []
    tbf = ""
    if rate_bytes_per_s > 0:
        burst = args.burst or str(max(256 * 1024, math.ceil(rate_bytes_per_s * 0.002)))
        tbf = f"tbf rate {label} burst {burst} latency {args.tbf_latency}"
    if args.delay:
        commands.append(f"tc qdisc add dev lo root handle 1: netem delay {args.delay} limit 100000")
        if tbf:
            commands.append(f"tc qdisc add dev lo parent 1:1 handle 10: {tbf}")
    elif tbf:
        commands.append(f"tc qdisc add dev lo root handle 1: {tbf}")
    return commands


def worker_flags(args: argparse.Namespace, label: str, rate: float, json_path: Path) -> list[str]:
    flags = [
        f"--json={json_path}",
        f"--rate-label={label}",
        f"--rate-bytes-per-s={rate!r}",
        f"--rows={','.join(parse_rows(args.rows))}",
    ]
    if args.interleave:
        flags.append("--interleave")
    for name in (
        "width",
        "layers",
        "heads",
        "context",
        "batch_size",
        "text_bytes",
        "lr",
        "adamw",
        "lr_warmup",
        "seed",
        "steps",
        "rounds",
        "warmup",
        "profile_steps",
        "threshold",
        "threshold_density",
        "threshold_how",
        "powersgd_rank",
        "bucket_cap_mb",
        "target_loss",
        "target_max_steps",
        "target_max_seconds",
        "eval_every",
        "link_seconds",
    ):
        value = getattr(args, name)
        if value is not None:
            text = value if isinstance(value, str) else repr(value)
            flags.append(f"--{name.replace('_', '-')}={text}")
    return flags


def kill_namespace(proc: subprocess.Popen) -> list[int]:
    """Kill every process in ``proc``'s network namespace (``proc`` is the ``unshare`` this
    script started), by process id; then ``proc`` itself. Returns the ids killed."""
    killed = []
    try:
        netns = os.readlink(f"/proc/{proc.pid}/ns/net")
        ours = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ours = None
    if netns and ours and netns != ours:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (1, os.getpid(), proc.pid):
                continue
            try:
                if os.readlink(entry / "ns" / "net") == netns:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
    try:
        proc.terminate()  # --kill-child: unshare SIGKILLs the namespace's init on its way out
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return killed


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_rate(rate_text: str, args: argparse.Namespace, out: Path) -> dict:
    """Launch the worker for one rate inside its own shaped namespace; return its results."""
    label, rate = parse_rate(rate_text)
    safe = re.sub(r"[^a-z0-9]+", "_", label)
    launches = out / "launches"  # per-launch files: the worker's log, tc's counters, raw JSON
    launches.mkdir(parents=True, exist_ok=True)
    json_path = launches / f"raw-{safe}.json"
    log_path = launches / f"log-{safe}.txt"
    stats_path = launches / f"qdisc-{safe}.txt"
    for path in (json_path, stats_path):
        path.unlink(missing_ok=True)
    commands = qdisc_commands(label, rate, args)
    script = "\n".join(
        [
            "set -e",
            "ip link set lo up",
            *commands,
            "set +e",
            '"$@"',
            "rc=$?",
            'tc -s qdisc show dev lo > "$BENCH_QDISC_STATS" 2>&1',
            "exit $rc",
        ]
    )
    threads = max(1, (os.cpu_count() or 1) // args.world_size)
    env = _tool_env()
    env.update(
        BENCH_QDISC_STATS=str(stats_path),
        PYTHONPATH=os.pathsep.join(
            p for p in [args.sparsecomm_path, str(REPO), env.get("PYTHONPATH")] if p
        ),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        GLOO_SOCKET_IFNAME="lo",
        NCCL_SOCKET_IFNAME="lo",
        NCCL_P2P_DISABLE="1",
        NCCL_SHM_DISABLE="1",
        NCCL_IB_DISABLE="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
    )
    command = [
        find_tool("unshare"),
        "--net",
        "--pid",
        "--fork",
        "--kill-child",
        "bash",
        "-c",
        script,
        "bench-network-ns",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world_size}",
        str(WORKER),
        *worker_flags(args, label, rate, json_path),
    ]
    print(
        f"== {label}: {'; '.join(commands) or 'no qdisc (unshaped loopback)'}; "
        f"{args.world_size} ranks, timeout {args.rate_timeout:g} s",
        flush=True,
    )
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(f"[{label}]"):
                    print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        status = "ok"
        try:
            returncode = proc.wait(timeout=args.rate_timeout)
        except subprocess.TimeoutExpired:
            killed = kill_namespace(proc)
            returncode = proc.returncode
            status = f"timed out after {args.rate_timeout:g} s (killed {len(killed)} processes)"
        except BaseException:  # Ctrl-C or SIGTERM: take the namespace down with us
            kill_namespace(proc)
            raise
        reader.join(timeout=10)
    seconds = time.perf_counter() - started
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    if status == "ok" and (returncode != 0 or not (data or {}).get("finished")):
        status = f"failed (exit {returncode})"
    if status != "ok":
        tail = log_path.read_text().splitlines()[-25:]
        print(f"== {label}: {status}; last lines of {log_path}:", file=sys.stderr)
        print("\n".join("   " + line for line in tail), file=sys.stderr)
    qdisc = stats_path.read_text() if stats_path.exists() else ""
    if data is not None:
        json_path.unlink()  # results.json holds it
    print(f"== {label}: {status} in {seconds:.0f} s", flush=True)
    return {
        "label": label,
        "set_bytes_per_s": rate or None,
        "qdisc": commands,
        "qdisc_stats": qdisc,
        "status": status,
        "seconds": seconds,
        "log": str(log_path),
        "data": data,
    }


# --------------------------------------------------------------------------- report


def _gbit(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else f"{bytes_per_s * 8 / 1e9:.3g}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2g}"


def _short_qdisc(command: str) -> str:
    """``tc qdisc add dev lo root handle 1: tbf rate 1gbit ...`` -> ``tbf rate 1gbit ...``."""
    return re.sub(r"^tc qdisc add dev lo (root|parent \S+) (handle \S+ )?", "", command)


def _rows_in_order(results: dict) -> list[str]:
    names: list[str] = []
    for rate in results["rates"]:
        for row in (rate["data"] or {}).get("rows", []):
            if row["row"] not in names:
                names.append(row["row"])
    return names


def _row(rate: dict, name: str) -> dict | None:
    for row in (rate["data"] or {}).get("rows", []):
        if row["row"] == name:
            return row
    return None


# Baselines each row is divided by, turn by turn, where both ran.
BASELINES = ("none", "ddp", "ddp+fp16")

# Issue 11's step-time targets on the network benchmark: (rate, row, baseline, at most).
# The hook door's row is compared with its optimizer door's, at every rate.
TARGETS = (
    ("1gbit", "TopK(0.01)", "ddp+fp16", 0.5),
    ("1gbit", "TopK(0.01)", "none", 1.3),
    ("unshaped", "TopK(0.01)", "ddp", 1.2),
)
HOOK_DOOR_TOLERANCE = 1.10


def turn_ratios(row: dict | None, baseline: dict | None) -> list[float]:
    """``row``'s turn medians over ``baseline``'s, turn by turn (empty unless both ran in
    the same turns)."""
    ours = (row or {}).get("round_medians") or []
    theirs = (baseline or {}).get("round_medians") or []
    if len(ours) < 2 or len(ours) != len(theirs):
        return []
    return [a / b for a, b in zip(ours, theirs)]


def _ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]"


def side_by_side(rates: list[dict], names: list[str]) -> list[str]:
    """Each row's step over each baseline's, turn by turn (median [min-max] of the turns'
    ratios), and issue 11's targets where their rows ran."""
    pairs = [(name, base) for name in names for base in BASELINES if base != name]
    pairs += [(name, name[len("ddp+sc-") :]) for name in names if name.startswith("ddp+sc-")]
    body = []
    for name, base in pairs:
        cells = [
            _ratio_text(r) if (r := turn_ratios(_row(rate, name), _row(rate, base))) else "-"
            for rate in rates
        ]
        if any(cell != "-" for cell in cells):
            body.append(f"| {name} / {base} | " + " | ".join(cells) + " |")
    if not body:
        return []
    lines = [
        "## Side by side: ratios turn by turn",
        "",
        "Each row's median step in a turn over the baseline's in the same round, seconds "
        "apart: the median of those ratios [their min-max]. The machine's speed drifts over "
        "minutes by more than the rows differ; these ratios do not see that drift.",
        "",
        "| row / baseline |" + "".join(f" {r['label']} |" for r in rates),
        "|---|" + "---:|" * len(rates),
        *body,
        "",
    ]

    def check(what: str, ratios: list[float], most: float) -> None:
        if ratios:
            verdict = "met" if statistics.median(ratios) <= most else "NOT met"
            checks.append(f"- {what}: {_ratio_text(ratios)}, {verdict}")

    checks: list[str] = []
    for rate in rates:
        for label, name, base, most in TARGETS:
            if rate["label"] == label:
                ratios = turn_ratios(_row(rate, name), _row(rate, base))
                check(f"{label}: `{name}` <= {most:g}x `{base}`", ratios, most)
        for name in names:
            if name.startswith("ddp+sc-"):
                ratios = turn_ratios(_row(rate, name), _row(rate, name[len("ddp+sc-") :]))
                within = f"{100 * (HOOK_DOOR_TOLERANCE - 1):.0f}%"
                what = f"{rate['label']}: the hook door `{name}` within {within} of the optimizer"
                check(what + " door", ratios, HOOK_DOOR_TOLERANCE)
    if checks:
        lines += ["Issue 11's targets on this benchmark:", "", *checks, ""]
    return lines


def format_report(results: dict) -> str:
    """The markdown report: set-up, link, step times, shares, targets, planner check."""
    rates = results["rates"]
    first = next((r["data"] for r in rates if r["data"]), None)
    cfg = results["config"]
    lines = [f"# Training-step time over a shaped loopback ({results['date']})", ""]
    if cfg.get("note"):
        lines += [cfg["note"], ""]
    if first is None:
        return "\n".join(lines + ["No rate produced results.", ""])
    world_size = first["world_size"]
    lines += [
        f"- Command: `{results['command']}` (took {results['seconds']:.0f} s)",
        f"- sparsecomm imported from `{first.get('sparsecomm', '?')}`; "
        f"torch {first['torch']}, backend {first['backend']}, {first['device']}, "
        f"{first['cpu_count']} cores, W = {world_size} ranks of {first['threads_per_rank']} "
        f"thread(s)",
        f"- Model: examples/train_charlm.py's CharTransformer, width {cfg['width']}, "
        f"{cfg['layers']} layers, {cfg['heads']} heads, context {cfg['context']}: "
        f"{first['params'] / 1e6:.2f}M parameters ({4 * first['params'] / 1e6:.1f} MB fp32); "
        f"AdamW{'(fused=True)' if cfg.get('adamw') == 'fused' else ''} lr {cfg['lr']:g}; "
        f"{cfg['batch_size']} windows per rank per step of the "
        "standard-library text; every row from the same initialization on the same data.",
        f"- Per row and rate: {cfg['warmup']} untimed steps, then {cfg['steps']} timed"
        + (" per turn" if cfg.get("interleave") else "")
        + "; a step "
        "is forward + backward + optimizer step, its time the slowest rank's. sparsecomm rows: "
        f"{cfg['profile_steps']} more steps with `profile=True` for the shares."
        + (
            (
                f" Every row was built once; then the rows took turns of {cfg['steps']} steps "
                f"{cfg['rounds']} times (every other round in reverse order); the figures pool "
                "every turn's timed steps."
                if cfg.get("interleave")
                else f" The rows took turns {cfg['rounds']} times (every other round in "
                "reverse order, each from a fresh model); the figures pool every round's "
                "timed steps."
            )
            if cfg.get("rounds", 1) > 1
            else ""
        ),
        "",
        "Loopback is one shared medium: every rank's traffic crosses the one shaped `lo` "
        f"queue, so the set rate is the total of all {world_size} ranks and each rank gets "
        f"about rate/{world_size} (two ranks on 300mbit behave like two machines with "
        f"{300 / world_size:.0f} Mbit/s links each). A ring all-reduce of S bytes moves "
        f"2(W-1)/W * S per rank, so {world_size} ranks put 2(W-1) * S = "
        f"{2 * (world_size - 1)} * S bytes through the queue: achieved = that / time.",
        "",
        "## The link",
        "",
        "| rate | qdisc | all-reduce | time s | through lo, Gbit/s | of set rate | per rank, "
        "Gbit/s | 1-float all-reduce |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for rate in rates:
        link = (rate["data"] or {}).get("link") or {}
        if "aggregate_bytes_per_s" not in link:
            lines.append(f"| {rate['label']} | | {rate['status']} | | | | | |")
            continue
        ratio = link.get("ratio_to_set")
        lines.append(
            f"| {rate['label']} | {'; '.join(_short_qdisc(c) for c in rate['qdisc']) or '-'} "
            f"| {link['allreduce_bytes'] / 1e6:.1f} MB x {link['reps']} | {link['seconds']:.2f} "
            f"| {_gbit(link['aggregate_bytes_per_s'])} | "
            f"{'-' if ratio is None else f'{100 * ratio:.0f}%'} | "
            f"{_gbit(link['per_rank_bytes_per_s'])} | {link['small_allreduce_s'] * 1e6:.0f} us |"
        )
    lines.append("")
    threshold = next((r["data"].get("threshold") for r in rates if r["data"]), None)
    skipped: dict[str, str] = {}
    for rate in rates:
        for item in (rate["data"] or {}).get("skipped", []):
            skipped.setdefault(item["row"], item["reason"])

    names = _rows_in_order(results)
    header = "| row | MB / rank / step | density |" + "".join(
        f" {r['label']}: ms median [p20-p80] |" for r in rates
    )
    lines += [
        "## Step time",
        "",
        header,
        "|---|---:|---:|" + "---:|" * len(rates),
    ]
    for name in names:
        known = next(r for r in (_row(rate, name) for rate in rates) if r)
        mb = known["bytes_per_step"]
        density = known["density"]
        cells = []
        for rate in rates:
            row = _row(rate, name)
            if row is None:
                cells.append("-")
                continue
            s = row["step_s"]
            cells.append(f"{_ms(s['median'])} [{_ms(s['p20'])}-{_ms(s['p80'])}]")
        lines.append(
            f"| {name} | {'n/a' if mb is None else f'{mb / 1e6:.3g}'} | "
            f"{'-' if density is None else f'{100 * density:.3g}%'} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "MB / rank / step: the payload each rank puts into the collectives per step (the "
        "first rate's median), as `StepStats.bytes_sent` counts it: measured "
        "(`opt.last_stats.bytes_sent`) for sparsecomm rows; for DDP computed from the model "
        "(4 B x parameters fp32, 2 B with the fp16/bf16 hooks) and for PowerSGD counted by its "
        "state (4 B x `total_numel_after_compression` per step). A ring all-reduce puts "
        "2(W-1)/W times its payload on the wire per rank, an all-gather W-1 times: at W = 2 "
        "both equal the payload. Density: elements sent / elements (sparsecomm rows; small "
        "parameters always travel dense).",
    ]
    if threshold:
        lines.append(f"Threshold(t): {threshold['how']}.")
    for name, reason in skipped.items():
        lines.append(f"Skipped `{name}`: {reason}.")
    lines.append("")

    sc_names = [n for n in names if any((_row(r, n) or {}).get("profile") for r in rates)]
    if sc_names:
        lines += [
            "## Where sparsecomm's step goes (profile=True)",
            "",
            "Share of the profiled step spent compressing / communicating / aggregating "
            "(`last_stats.compress_seconds`, `communicate_seconds`, `aggregate_seconds`); the "
            "rest is forward, backward, the optimizer and bucket copies.",
            "",
            "| row |" + "".join(f" {r['label']} |" for r in rates),
            "|---|" + "---:|" * len(rates),
        ]
        for name in sc_names:
            cells = []
            for rate in rates:
                prof = (_row(rate, name) or {}).get("profile")
                cells.append(
                    "-"
                    if not prof
                    else f"{100 * prof['compress_share']:.0f}% / "
                    f"{100 * prof['communicate_share']:.0f}% / "
                    f"{100 * prof['aggregate_share']:.0f}%"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")

    lines += side_by_side(rates, names)

    if cfg.get("target_loss") is not None:
        lines += [
            f"## Time to validation loss {cfg['target_loss']:g}",
            "",
            f"Training seconds (evaluations every {cfg['eval_every']} steps not counted) and "
            f"steps; bounded by {cfg['target_max_steps']} steps and "
            f"{cfg['target_max_seconds']:g} s. `none` is rank 0's model trained on its "
            "share of the data alone.",
            "",
            "| row |" + "".join(f" {r['label']} |" for r in rates),
            "|---|" + "---:|" * len(rates),
        ]
        for name in names:
            cells = []
            for rate in rates:
                target = (_row(rate, name) or {}).get("target")
                if not target:
                    cells.append("-")
                elif target["reached"]:
                    cells.append(f"{target['seconds']:.1f} s ({target['steps']} steps)")
                else:
                    cells.append(
                        f"not reached: {target['val_loss']:.3f} after {target['steps']} "
                        f"steps, {target['seconds']:.0f} s"
                    )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")

    check = results.get("planner")
    if check:
        lines += [
            "## The planner on these rows",
            "",
            check["how"],
            "",
            "| rate | per-rank bandwidth | planner recommends | its model, ms | measured, ms "
            "[p20-p80] | measured fastest | measured, ms [p20-p80] | gap | agree |",
            "|---|---:|---|---:|---:|---|---:|---:|---|",
        ]

        def spread(step):
            if not step:
                return "-"
            return f"{_ms(step['median'])} [{_ms(step['p20'])}-{_ms(step['p80'])}]"

        for item in check["rates"]:
            gap = item.get("gap")
            lines.append(
                f"| {item['rate']} | {_gbit(item['bandwidth'])} Gbit/s | {item['recommended']} "
                f"| {_ms(item['predicted_s'])} | {spread(item.get('recommended_measured'))} "
                f"| {item['fastest']} | {spread(item.get('fastest_measured'))} "
                f"| {'-' if gap is None else f'{100 * gap:+.1f}%'} | {item['agree']} |"
            )
        lines.append("")
    for rate in rates:
        if rate["status"] != "ok":
            lines.append(f"Rate {rate['label']}: {rate['status']}.")
    return "\n".join(lines).rstrip() + "\n"


def plot(results: dict, path: Path) -> bool:
    """Median step time against the measured link rate, one line per row (log x)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    points = []
    for rate in results["rates"]:
        link = (rate["data"] or {}).get("link") or {}
        if "aggregate_bytes_per_s" in link:
            points.append((link["aggregate_bytes_per_s"] * 8 / 1e9, rate))
    if not points:
        return False
    points.sort(key=lambda p: p[0])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = ["-o", "-s", "-^", "-v", "-D", "-P", "-X", "-*", "-<", "->", "-h", "-p"]
    for index, name in enumerate(_rows_in_order(results)):
        xs, ys = [], []
        for x, rate in points:
            row = _row(rate, name)
            if row:
                xs.append(x)
                ys.append(row["step_s"]["median"])
        dashed = "--" if name.startswith("ddp") or name == "none" else ""
        style = styles[index % len(styles)]
        ax.plot(xs, ys, (dashed + style[1:]) if dashed else style, label=name, markersize=5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([x for x, _ in points])
    ax.set_xticklabels([f"{r['label']}\n{x:.3g} Gbit/s" for x, r in points])
    ax.minorticks_off()
    first = next(r["data"] for _, r in points)
    ax.set_xlabel(
        f"link rate through the shared loopback (measured; each of the {first['world_size']} "
        "ranks gets 1/W of it)"
    )
    ax.set_ylabel("median step time, s (forward + backward + optimizer)")
    note = results["config"].get("note")
    ax.set_title(
        f"{first['params'] / 1e6:.3g}M-parameter transformer, W={first['world_size']}, "
        f"{first['backend']}, {results['date']}" + (f"\n{note}" if note else ""),
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- planner check

# bench row -> the planner's row name (the planner models sparsecomm's compressors).
_PLAN_NAMES = {
    "Dense()": "Dense fp32",
    "Cast(bf16)": "Cast bf16",
    "Cast(fp16)": "Cast fp16",
}


def _plan_name(row: str, density: float | None) -> str | None:
    from sparsecomm.plan import _pct

    if "/" in row or "@" in row:  # the planner models the gradient exchange, default buckets
        return None
    if row in _PLAN_NAMES:
        return _PLAN_NAMES[row]
    if row.startswith("TopK("):
        return f"TopK {_pct(float(row[5:-1]))}"
    if row.startswith("Threshold(") and density:
        return f"Threshold {_pct(density)}"
    return None


def agrees(pick: dict, fastest: dict) -> bool:
    """The agreement rule of the planner check: the pick is the fastest measured row, or its
    p20-p80 range of step times overlaps the fastest row's (``pick p20 <= fastest p80``): the
    run's own noise cannot say which of the two is faster. ``pick``, ``fastest``: a row's
    ``step_s`` (median, p20, p80)."""
    return pick is fastest or pick["p20"] <= fastest["p80"]


def _bucket_cap(results: dict):
    """The bucket sizes a stored run's sparsecomm rows used, for the planner's model: its
    ``bucket_caps`` ([dense rows, sparse rows]), else its ``--bucket-cap-mb`` (runs before
    the sizes were stored), else None (the defaults)."""
    config = results.get("config") or {}
    caps = config.get("bucket_caps")
    return tuple(caps) if caps else config.get("bucket_cap_mb")


def _checkable_rates(results: dict):
    """``(rate, data, link, none row)`` for each rate with a measured link and a `none` row."""
    for rate in results["rates"]:
        data = rate["data"] or {}
        link = data.get("link") or {}
        none = _row(rate, "none")
        if "aggregate_bytes_per_s" in link and none is not None:
            yield rate, data, link, none


def _fit_overlap(results: dict, host_bandwidth: float | None) -> float | None:
    """The overlap fraction this run shows: for each Dense() and Cast row whose modelled
    communication outlasts backward (so the hideable part is used up), the seconds the
    measured step is under the no-overlap model, over backward; the median, in [0, 1]."""
    from sparsecomm import plan as planner

    fits = []
    for _rate, data, link, none in _checkable_rates(results):
        world_size, params = data["world_size"], data["params"]
        backward = none["phases_s"]["backward"]
        for row in data.get("rows", []):
            if row["row"] not in ("Dense()", "Cast(bf16)", "Cast(fp16)") or "profile" not in row:
                continue
            name = _PLAN_NAMES[row["row"]]
            prof = row["profile"]
            (model,) = [
                r
                for r in planner.plan(
                    params,
                    world_size,
                    link["aggregate_bytes_per_s"] / world_size,
                    latency=link["small_allreduce_s"] / (2 * (world_size - 1)),
                    compress_ns_per_element={
                        name: (prof["compress_s"] + prof["aggregate_s"]) / params * 1e9
                    },
                    compute_seconds=none["step_s"]["median"],
                    overlap=0.0,
                    host_bandwidth=host_bandwidth,
                    bucket_cap_mb=_bucket_cap(results),
                )
                if r.name == name
            ]
            if backward > 0 and model.time_s > backward:
                fits.append((model.step_s - row["step_s"]["median"]) / backward)
    if not fits:
        return None
    return min(1.0, max(0.0, statistics.median(fits)))


def _host_bandwidth(results: dict) -> float | None:
    """The per-rank rate of the run's unshaped loopback (what gloo reaches when the cores
    move the bytes with nothing shaping them), or None without an unshaped rate."""
    for rate in results["rates"]:
        link = (rate["data"] or {}).get("link") or {}
        if rate["label"] == "unshaped" and "aggregate_bytes_per_s" in link:
            return link["aggregate_bytes_per_s"] / rate["data"]["world_size"]
    return None


def planner_check(
    results: dict, overlap: float | None = None, host_bandwidth: float | None = None
) -> dict | None:
    """Feed the planner this run's numbers and compare its pick with the fastest measured
    sparsecomm row at each rate, by :func:`agrees`.

    ``overlap``: the planner's overlap fraction; None fits it to this run's Dense and Cast
    rows (:func:`_fit_overlap`). ``host_bandwidth`` (bytes/s per rank): None takes the run's
    unshaped loopback rate, if it has one (``float("inf")``: the transport costs no compute)."""
    try:
        from sparsecomm import plan as planner
    except ImportError:
        return None
    if host_bandwidth is None:
        host_bandwidth = _host_bandwidth(results)
    fitted = overlap is None
    if fitted:
        overlap = _fit_overlap(results, host_bandwidth)
        if overlap is None:
            overlap = 0.0
    out = []
    for rate, data, link, none in _checkable_rates(results):
        world_size, params = data["world_size"], data["params"]
        measured = {}
        costs = {}
        densities, threshold_densities = [], []
        for row in data.get("rows", []):
            if "profile" not in row:
                continue
            name = _plan_name(row["row"], row["density"])
            if name is None:
                continue
            prof = row["profile"]
            costs[name] = (prof["compress_s"] + prof["aggregate_s"]) / params * 1e9
            measured[name] = (row["row"], row["step_s"])
            if row["row"].startswith("TopK("):
                densities.append(float(row["row"][5:-1]))
            if row["row"].startswith("Threshold("):
                threshold_densities.append(float(f"{row['density']:.3g}"))
        if not measured:
            continue
        bandwidth = link["aggregate_bytes_per_s"] / world_size
        rows = planner.plan(
            params,
            world_size,
            bandwidth,
            latency=link["small_allreduce_s"] / (2 * (world_size - 1)),
            densities=densities or planner.DEFAULT_DENSITIES,
            threshold_densities=threshold_densities or None,
            compress_ns_per_element=costs,
            compute_seconds=none["step_s"]["median"],
            backward_seconds=none["phases_s"]["backward"],
            bucket_cap_mb=_bucket_cap(results),
            overlap=overlap,
            host_bandwidth=host_bandwidth,
        )
        candidates = [r for r in rows if r.name in measured]
        pick = planner.pick(candidates)
        fastest = min(measured.values(), key=lambda item: item[1]["median"])
        mine = measured[pick.name]
        out.append(
            {
                "rate": rate["label"],
                "bandwidth": bandwidth,
                "recommended": mine[0],
                "predicted_s": pick.step_s,
                "recommended_measured": mine[1],
                "fastest": fastest[0],
                "fastest_s": fastest[1]["median"],
                "fastest_measured": fastest[1],
                "gap": mine[1]["median"] / fastest[1]["median"] - 1,
                "agree": "yes" if agrees(mine[1], fastest[1]) else "no",
                "model": {r.name: r.step_s for r in candidates},
                "measured": {k: v[1]["median"] for k, v in measured.items()},
                "compress_ns_per_element": costs,
            }
        )
    if not out:
        return None
    host = (
        f"host bandwidth {host_bandwidth * 8 / 1e9:.3g} Gbit/s per rank (the unshaped "
        "loopback's: each byte costs the cores 1/host bandwidth, never hidden)"
        if host_bandwidth
        else "no host bandwidth (the transport costs no compute time)"
    )
    how = (
        "`sparsecomm.plan.plan()` given this run's numbers: per-rank bandwidth = measured "
        "through-lo rate / W (loopback is one shared medium), latency = the 1-float all-reduce "
        "/ 2(W-1), compute = the `none` row's step, backward = its backward phase, compression "
        "+ aggregation cost per element from each row's profiled steps, "
        + host
        + f", overlap {overlap:.2g}"
        + (
            " (fitted to this run's Dense and Cast rows whose communication outlasts backward)"
            if fitted
            else ""
        )
        + ": step = compute + compress + bytes / host bandwidth + max(last bucket's "
        "communication, communication - overlap x backward). It picks among the sparsecomm "
        "rows measured here; measured fastest is the lowest median of those rows. Agree: the "
        "pick is the fastest, or its p20-p80 step range overlaps the fastest's (pick p20 <= "
        "fastest p80), so this run cannot tell the two apart; gap = pick's median / fastest's "
        "- 1."
    )
    return {"how": how, "overlap": overlap, "host_bandwidth": host_bandwidth, "rates": out}


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        rates = [r for r in args.rates.split(",") if r.strip()]
        if not rates:
            raise ValueError("--rates is empty; e.g. --rates unshaped,1gbit,300mbit")
        for rate in rates:
            parse_rate(rate)
        parse_rows(args.rows)
        if args.delay:
            args.delay = parse_tc_time(args.delay, "--delay")
        args.tbf_latency = parse_tc_time(args.tbf_latency, "--tbf-latency")
        if args.world_size < 1 or args.steps < 1 or args.warmup < 0:
            raise ValueError("--world-size and --steps must be >= 1, --warmup >= 0")
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out)
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        if args.note is not None:
            results["config"]["note"] = args.note
        out.mkdir(parents=True, exist_ok=True)
        return _write_report(results, args, out)
    if args.sparsecomm_path and not (Path(args.sparsecomm_path) / "sparsecomm").is_dir():
        parser.error(f"--sparsecomm-path {args.sparsecomm_path}: no sparsecomm/ directory in it")
    missing = missing_prerequisite(delay=bool(args.delay))
    if missing:
        print(missing, file=sys.stderr)
        return 3
    out.mkdir(parents=True, exist_ok=True)
    # SIGTERM ends the run as Ctrl-C does: run_rate then kills the namespace it started.
    signal.signal(signal.SIGTERM, _interrupt)
    script = os.path.relpath(__file__)
    script = __file__ if script.startswith("..") else script
    command = "python " + shlex.join([script, *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    from sparsecomm import plan as planner

    results = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # The bucket sizes the sparsecomm rows ran with, [dense rows, sparse rows] in MiB (so
        # that the planner check models this run with them, whatever the defaults become).
        "config": dict(vars(args), bucket_caps=list(planner.bucket_caps(args.bucket_cap_mb))),
        "rates": [],
    }
    print(
        f"bench_network: W={args.world_size}; loopback is one shared medium: each rank gets "
        f"about rate/{args.world_size}",
        flush=True,
    )
    for rate in rates:
        results["rates"].append(run_rate(rate, args, out))
        threshold = (results["rates"][-1]["data"] or {}).get("threshold")
        if threshold and args.threshold is None:
            # Calibrated once, at the first rate; the later rates use the same t.
            args.threshold, args.threshold_how = threshold["t"], threshold["how"]
    results["seconds"] = time.perf_counter() - started
    params = next((r["data"]["params"] for r in results["rates"] if r.get("data")), 0)
    if params:  # the defaults depend on the model's size: what these rows ran with
        results["config"]["bucket_caps"] = list(planner.bucket_caps(args.bucket_cap_mb, params))
    return _write_report(results, args, out)


def _write_report(results: dict, args: argparse.Namespace, out: Path) -> int:
    results["planner"] = planner_check(results, args.planner_overlap)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = format_report(results)
    (out / "table.md").write_text(report)
    plotted = plot(results, out / "network.png")
    print()
    print(report)
    print(
        f"wrote {out / 'table.md'}, {out / 'results.json'}"
        + (f", {out / 'network.png'}" if plotted else "")
    )
    return 0 if all(r["status"] == "ok" for r in results["rates"]) else 1


if __name__ == "__main__":
    sys.exit(main())
