"""The planner's network model on a shaped link: measured against predicted step times of the two placements of two
ranks on two hosts (network namespaces, scripts/netns-cluster.sh; needs root), for each inter-host link rate.

    sudo python benchmarks/multihost_link.py --rates off 200mbit 20mbit --out runs/multihost-link
    python benchmarks/multihost_link.py --report runs/multihost-link      # reprint the table of what is stored

Per rate: the link is shaped with tbf; the machine is calibrated the way `pipetrain plan --calibrate` does it in a
job that spans hosts (torchrun across the two hosts, c10d rendezvous: every rank measures the inter-host link with
`bench.internode`, rank 0 then calibrates its own node, here with `--samples`/`--repeats` smaller than plan's
256/9 so that a rate fits in minutes); then two cells run `pipetrain train` (cpu preset, synthetic data, global
batch 64) with one rank per host: **pp across the hosts** (pp=2, gpipe, 4 micro-batches: activations and their
gradients cross the link) and **dp across the hosts** (dp=2, DDP: the gradients' all-reduce crosses it). Measured:
the median `step_time_s` of steps 2..N (steps.jsonl); predicted: `plan.predict` on that calibration with one
rank per node (`gpus_per_node=1`). Rows are stored as JSON in --out, one file per rate; the table is printed
from all of them: per cell the error, per rate which placement is faster, measured and predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESET, BATCH = "cpu", 64
CELLS = {"pp across hosts": dict(dp=1, pp=2, chunks=4, schedule="gpipe"),
         "dp across hosts": dict(dp=2, pp=1, chunks=1, schedule="gpipe")}


def _shape() -> dict:
    from pipetrain.workloads.classifier.presets import PRESETS

    c = PRESETS[PRESET]
    return dict(seq_len=c.seq_len, emsize=c.emsize, nhead=c.nhead, nhid=c.nhid, dropout=c.dropout)


def calibrate_rank(path: Path, samples: int, repeats: int) -> None:
    """One rank of the calibration job (torchrun across the hosts): `plan --calibrate`'s path, smaller sizes."""
    from pipetrain.bench.calibrate import calibrate
    from pipetrain.bench.internode import measure_inter_node
    from pipetrain.launch.env import detect, without_launcher_variables
    from pipetrain.plan.hardware import save_calibration

    env = detect()
    inter = measure_inter_node(env)
    if env.rank == 0:
        with without_launcher_variables():
            save_calibration(calibrate(_shape(), samples=samples, repeats=repeats, inter=inter), path)


def _calibrate(cluster, folder: Path, rate: str, samples: int, repeats: int) -> Path:
    from scripts.netns_cluster import environ, torchrun, wait_all

    path = folder / f"calibration-{rate}.json"
    me = [str(Path(__file__).resolve()), "--calibrate-rank", str(path), "--samples", str(samples),
          "--repeats", str(repeats)]
    processes = []
    for node in (0, 1):
        processes.append(cluster.start(node, torchrun(node, 1, *me, job_id=f"cal{rate}"), environ(),
                                       f"cal-{rate}-h{node}.log"))
    codes = wait_all(processes, 900.0)
    if codes != [0, 0]:
        raise SystemExit(f"calibration at {rate} ended with {codes}:\n{cluster.output(f'cal-{rate}-h0.log')[-3000:]}")
    return path


def _cell(cluster, folder: Path, name: str, steps: int) -> float:
    from scripts.netns_cluster import ADDRESSES, MASTER_PORT, environ, wait_all

    cell = CELLS[name]
    run_dir = folder / name.replace(" ", "-")
    job = ["-m", "pipetrain", "train", "--preset", PRESET, "--data", "synthetic", "--batch-size", str(BATCH),
           "--train-samples", str(BATCH * steps), "--test-samples", "16", "--epochs", "1", "--max-steps", str(steps),
           "--no-progress", "--dp", str(cell["dp"]), "--pp", str(cell["pp"]), "--chunks", str(cell["chunks"]),
           "--schedule", cell["schedule"], "--step-timeout", "120", "--run-dir", str(run_dir)]
    common = {"WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0",
              "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": str(MASTER_PORT)}
    processes = [cluster.start(rank, [sys.executable, *job], environ(**common, RANK=str(rank), GROUP_RANK=str(rank)),
                               f"{run_dir.name}-rank{rank}.log") for rank in (0, 1)]
    codes = wait_all(processes, 900.0)
    if codes != [0, 0]:
        raise SystemExit(f"{name} ended with {codes}:\n{cluster.output(f'{run_dir.name}-rank0.log')[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in records if r["kind"] == "step" and r["step"] > 1]
    return statistics.median(times)


def _predicted(calibration: Path, *, shared_cores: bool) -> dict[str, float]:
    """`plan.predict`'s step time per cell. The two namespace hosts share this machine's cores: with `shared_cores`
    the ranks are planned as one node's (sharing its calibrated cores) whose every link is the measured inter-host
    one; without, as on a cluster (`gpus_per_node=1`: each host's cores its own)."""
    from dataclasses import replace

    from pipetrain.plan.hardware import load_calibration
    from pipetrain.plan.model import config_blocks
    from pipetrain.plan.predict import Layout, predict
    from pipetrain.workloads.classifier.presets import PRESETS

    calib = load_calibration(calibration)
    blocks = config_blocks(PRESETS[PRESET])
    network, per_node = calib.network, 1
    if shared_cores:
        latency, bandwidth = network.across_collective()
        network = replace(network, p2p_latency_s=network.inter_latency_s, p2p_bytes_per_s=network.inter_bytes_per_s,
                          collective_latency_s=latency, collective_bytes_per_s=bandwidth)
        per_node = 2
    return {name: predict(blocks, Layout(batch=BATCH, gpus_per_node=per_node, **cell), calib.device, network).step_s
            for name, cell in CELLS.items()}


def measure_rate(rate: str, out: Path, steps: int, samples: int, repeats: int) -> None:
    from scripts.netns_cluster import Cluster

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(name=f"bl{os.getpid() % 100000}", folder=Path(tmp))
        cluster.up(rate)
        try:
            start = time.monotonic()
            calibration = _calibrate(cluster, Path(tmp), rate, samples, repeats)
            calibrated_s = time.monotonic() - start
            measured = {name: _cell(cluster, Path(tmp), name, steps) for name in CELLS}
        finally:
            cluster.down()
        out.mkdir(parents=True, exist_ok=True)
        stored = json.loads(calibration.read_text())
        (out / f"calibration-{rate}.json").write_text(json.dumps(stored, indent=2))
    row = {"rate": rate, "measured_s": measured, "network": stored["network"], "load_before": load, "load_after": os.getloadavg()[0],
           "calibration_s": calibrated_s, "steps": steps, "samples": samples, "repeats": repeats}
    (out / f"rate-{rate}.json").write_text(json.dumps(row, indent=2))


def _rate_bits(rate: str) -> float:
    if rate == "off":
        return float("inf")
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    return float("nan")


def report(out: Path) -> None:
    rows = sorted((json.loads(p.read_text()) for p in out.glob("rate-*.json")), key=lambda r: -_rate_bits(r["rate"]))
    if not rows:
        raise SystemExit(f"no rate-*.json in {out}: measure first (--rates)")
    for row in rows:  # predicted now, from the stored calibration: a change to the planner shows in the reprint
        calibration = out / f"calibration-{row['rate']}.json"
        row["predicted_s"] = _predicted(calibration, shared_cores=True)
        row["cluster_s"] = _predicted(calibration, shared_cores=False)
    print(f"cpu preset, global batch {BATCH}, 2 ranks (one per host); pp cell: pp=2 gpipe 4 micro-batches, "
          "dp cell: dp=2 DDP")
    print("| link (tbf) | calibrated inter-host p2p / all-reduce bus | cell | measured s/step | predicted | error | "
          "predicted, hosts with own cores |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    errors, right = [], []
    for row in rows:
        net = row["network"]
        link = (f"{net['inter_bytes_per_s'] / 1e6:.1f} / {net['inter_collective_bytes_per_s'] / 1e6:.1f} MB/s, "
                f"{net['inter_latency_s'] * 1e6:.0f} µs")
        for name in CELLS:
            got, want = row["measured_s"][name], row["predicted_s"][name]
            errors.append(abs(want - got) / got)
            print(f"| {row['rate']} | {link} | {name} | {got:.3f} | {want:.3f} | {100 * (want - got) / got:+.1f} % | "
                  f"{row['cluster_s'][name]:.3f} |")
    print("\n| link (tbf) | faster, measured | faster, predicted | measured pp/dp | predicted pp/dp | load avg |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        m, p = row["measured_s"], row["predicted_s"]
        fast_m, fast_p = min(m, key=m.get), min(p, key=p.get)
        right.append(fast_m == fast_p)
        pp, dp = CELLS
        print(f"| {row['rate']} | {fast_m} | {fast_p} | {m[pp] / m[dp]:.2f} | {p[pp] / p[dp]:.2f} | "
              f"{row['load_before']:.1f} → {row['load_after']:.1f} |")
    print(f"\nmedian |error| {100 * statistics.median(errors):.1f} % over {len(errors)} cells (max "
          f"{100 * max(errors):.1f} %); faster placement predicted right at {sum(right)} of {len(right)} rates")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="*", default=[], help="tbf rates to measure, e.g. off 200mbit 20mbit")
    parser.add_argument("--out", type=Path, default=Path("runs/multihost-link"))
    parser.add_argument("--report", type=Path, default=None, metavar="FOLDER", help="only print the stored table")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--samples", type=int, default=64, help="calibration: largest micro-batch timed")
    parser.add_argument("--repeats", type=int, default=3, help="calibration: repeats per timing")
    parser.add_argument("--calibrate-rank", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.calibrate_rank is not None:
        calibrate_rank(args.calibrate_rank, args.samples, args.repeats)
        return
    for rate in args.rates:
        measure_rate(rate, args.out, args.steps, args.samples, args.repeats)
    report(args.report or args.out)


if __name__ == "__main__":
    main()
