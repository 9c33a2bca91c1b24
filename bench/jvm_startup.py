"""CPU of a short Spark process: full tiered JIT vs. C1 only, with and without the class archive.

The test suite starts dozens of Spark processes that live seconds to a minute (CLI backfills,
role processes, Airflow tasks). The JVM's C2 compiler threads then compete with the work for
the two cores. This bench runs the same ``iotlake backfill --layer silver --layer gold`` over a
small bronze table (500 rows), alternating default JIT and ``-XX:TieredStopAtLevel=1``, and
measures the wall time and the CPU of the whole process tree. A third mode, C1 without the
driver's class-data-sharing archive (``spark.class_data_sharing = false``), measures what the
archive ``make`` builds saves; others try serial GC and loading without bytecode verification
(``--modes``). Orphaned JVMs are counted too:
the launcher is a child subreaper. Last line: one JSON object with the medians and
``cpu_ratio`` (default / C1), ``archive_cpu_ratio`` (no archive / C1 with it) and a
``<mode>_cpu_ratio`` for each other mode run.

    .venv/bin/python bench/jvm_startup.py [--runs 3]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleets import SENSOR, toml_text  # noqa: E402

from ingest.simulator import generate  # noqa: E402
from lakehouse.settings import load_settings  # noqa: E402
from tests.lakehouse_fixture import write_bronze  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36
NO_VERIFY = "-XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
#: mode -> (JAVA_TOOL_OPTIONS, lines added to the [spark] section of the config)
MODES = {"default": ("", ""), "c1": ("-XX:TieredStopAtLevel=1", ""),
         "c1_no_archive": ("-XX:TieredStopAtLevel=1", "class_data_sharing = false\n"),
         "c1_serial_gc": ("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC", ""),
         # classes from the class path loaded without bytecode verification (the JDK's own
         # classes are never verified): what the suite's short JVMs would save
         "c1_no_verify": (f"-XX:TieredStopAtLevel=1 {NO_VERIFY}", ""),
         "c1_serial_no_verify": (f"-XX:TieredStopAtLevel=1 -XX:+UseSerialGC {NO_VERIFY}", "")}


def build(root: Path) -> Path:
    """A lake with 500 bronze rows (duplicates and malformed included) and its config file."""
    lake = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(root),
                         spark={"master": "local[2]", "shuffle_partitions": 2})
    msgs = generate(lake, 500, devices=5, duplicates=12, malformed=8, rate=100.0,
                    start=datetime(2026, 11, 24, tzinfo=UTC))
    write_bronze(lake, msgs)
    config = root / "iotlake.toml"
    # bronze written here, not from Kafka: silver reads it (the layered topology); [spark] last:
    # the modes append their lines to it
    config.write_text(f'data_root = "{root}"\n[stream]\ntopology = "layered"\n{toml_text("sensor")}\n'
                      '[spark]\nmaster = "local[2]"\nshuffle_partitions = 2\n')
    return config


def run(config: Path, java_options: str, layers: tuple[str, ...] = ("silver", "gold")) -> tuple[float, float]:
    """(wall s, CPU s of every descendant) of one backfill; all descendants are reaped here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    env |= {"IOTLAKE_CONFIG": str(config), "JAVA_TOOL_OPTIONS": java_options}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    layer_args = [a for layer in layers for a in ("--layer", layer)]
    proc = subprocess.run([str(Path(sys.executable).with_name("iotlake")), "backfill", *layer_args], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"backfill failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    while True:  # orphans (the JVM, Python workers) were re-parented here: wait for them all
        try:
            os.wait()
        except ChildProcessError:
            break
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"comma-separated modes to alternate (default: all of {', '.join(MODES)})")
    ap.add_argument("--smoke", action="store_true", help="a small run that checks the bench still works")
    args = ap.parse_args()
    wanted = args.modes.split(",")
    unknown = set(wanted) - MODES.keys()
    if unknown:
        ap.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(MODES)}")
    modes = {m: MODES[m] for m in wanted}
    if args.smoke:  # one run, C1 only, silver only: checks the bench works, measures nothing
        args.runs, modes = 1, {"c1": MODES["c1"]}
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit("prctl(PR_SET_CHILD_SUBREAPER) failed: Linux only")
    tmp = Path(tempfile.mkdtemp(prefix="iotlake-jvm-"))
    try:
        template = tmp / "template"
        build(template)
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        for i in range(args.runs):
            for mode in modes:
                root = tmp / f"{mode}-{i}"
                shutil.copytree(template, root)
                config = root / "iotlake.toml"  # the copy points at its own lake
                opts, spark_lines = modes[mode]
                config.write_text(config.read_text().replace(str(template), str(root)) + spark_lines)
                wall, cpu = run(config, opts, ("silver",) if args.smoke else ("silver", "gold"))
                results[mode].append((wall, cpu))
                print(f"{mode:13s} run {i}: wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {m: {"wall_s": round(statistics.median(w for w, _ in r), 2),
               "cpu_s": round(statistics.median(c for _, c in r), 2)} for m, r in results.items()}
    # <key>_cpu_ratio / <key>_wall_ratio: that mode against C1 with the archive
    for key, mode in (("", "default"), ("serial_gc_", "c1_serial_gc"), ("archive_", "c1_no_archive"),
                      ("no_verify_", "c1_no_verify"), ("serial_no_verify_", "c1_serial_no_verify")):
        if mode in out and "c1" in out:
            for m in ("cpu", "wall"):
                out[f"{key}{m}_ratio"] = round(out[mode][f"{m}_s"] / out["c1"][f"{m}_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
