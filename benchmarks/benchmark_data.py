"""Measure data preparation: throughput with 1, 2 and all worker processes, and peak memory, on synthetic .jsonl
corpora of the given sizes that it writes itself (no download, no pyarrow or zstandard needed).

    python benchmarks/benchmark_data.py --sizes_mb 250 1000                  # workers 1, 2 and all cores
    python benchmarks/benchmark_data.py --sizes_mb 250 1000 --workers 1 8 16 --workdir /scratch/bench

Each measurement is one `scripts/prepare_data.py` process with a tokenizer trained once beforehand: the streaming
pass that grows with the corpus. Peak memory is sampled from /proc over the process and its workers (`tree_memory`).
CPU time over wall time says how many cores a run had (the load average is the last column), MB per CPU-second
whether the work grew with the workers. Prints a markdown table and the projected time for 100 GB."""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "train_tiny_fsdp.yaml"
SYLLABLES = "ka to ri en an mo lu si ter pro de in ex con al ver na be qu ol um tra is or".split()


# ---------------------------------------------------------------- the synthetic corpus


def write_corpus(path: Path, size_mb: float, *, seed: int = 0, meta_bytes: int = 0) -> Path:
    """Documents of Zipf-distributed pseudo-words in sentences of 6-20 words, one JSON object per line,
    until the file holds size_mb MB. The same bytes for the same (size, seed, meta_bytes). With meta_bytes,
    each document also has a "meta" field of that many bytes, which preparation parses but does not tokenise
    (as a corpus's URLs and other metadata): as many bytes to read, less text."""
    meta = {"meta": "m" * meta_bytes} if meta_bytes else {}
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(SYLLABLES, size=n)) for n in rng.integers(1, 4, size=30_000)])
    zipf = np.cumsum(1.0 / np.arange(1, len(words) + 1) ** 1.1)
    zipf /= zipf[-1]
    # A pool of sentences; every document draws its own sequence of them, so documents differ.
    lengths = rng.integers(6, 21, size=50_000)
    ids = np.searchsorted(zipf, rng.random(int(lengths.sum())))
    cuts = np.cumsum(lengths)[:-1]
    sentences = [" ".join(words[part]).capitalize() + "." for part in np.split(ids, cuts)]
    target, written = int(size_mb * 2**20), 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            picks = rng.integers(0, len(sentences), size=(256, 24))
            lines = [json.dumps({"text": " ".join(sentences[i] for i in row), **meta}) + "\n" for row in picks]
            block = "".join(lines)
            out.write(block)
            written += len(block)
    return path


# ---------------------------------------------------------------- measuring one run


def tree_memory(pid: int) -> list[tuple[int, int]]:
    """(resident, anonymous) bytes of a process and each of its descendants, from /proc. Anonymous memory (heap, what
    data would fill) is counted proportionally (Pss_Anon), so pages a parent shares with a child it forked count once;
    the resident size adds the mapped libraries, shared by every process that loads them."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        try:
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
            found.append(tuple(int(rollup.split(f"\n{key}:")[1].split()[0]) * 1024 for key in ("Rss", "Pss_Anon")))
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(kid) for kid in (task / "children").read_text().split()]
        except (OSError, IndexError):
            continue  # exited meanwhile
    return found


def prepare(corpus: Path | str, out: Path, *, workers: int, extra: list[str]) -> dict:
    """Run scripts/prepare_data.py once: wall and CPU time, peak memory, and what meta.json says."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), str(CONFIG), f"--data.files=[{corpus}]",
           f"--data.dataset_dir={out}", f"--data.num_workers={workers}", "--data.max_corpus_mb=0", *extra]
    cpu_before = _children_cpu_seconds()
    start = time.perf_counter()
    log = out.with_name(out.name + ".log")  # a file, not a pipe: a full pipe would stall the progress bar
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
        peak_anon = peak_rss = peak_one = 0
        while proc.poll() is None:
            memory = tree_memory(proc.pid)
            peak_anon = max(peak_anon, sum(anon for _, anon in memory))
            peak_rss = max(peak_rss, sum(rss for rss, _ in memory))
            peak_one = max([peak_one, *(rss for rss, _ in memory)])
            time.sleep(0.1)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"prepare_data.py failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {"seconds": seconds, "cpu_seconds": _children_cpu_seconds() - cpu_before, "phases": meta["seconds"],
            "text_bytes": meta["text_bytes"], "tokens": meta["num_train_tokens"] + meta["num_val_tokens"],
            "load": os.getloadavg()[0], "peak_anon": peak_anon, "peak_rss": peak_rss, "peak_one": peak_one}


def _children_cpu_seconds() -> float:
    """CPU time of the finished child processes and theirs (the workers, reaped by prepare_data.py)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------- the report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes_mb", type=float, nargs="+", default=[250, 1000], help="corpus sizes to measure")
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="worker counts (default: 1, 2 and all cores)")
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--workdir", default=None, help="where corpora and outputs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and outputs")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    workers = sorted(set(args.workers or [1, 2, cores]))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="benchmark_data_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report(args, workers, cores, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


def report(args, workers: list[int], cores: int, workdir: Path) -> None:
    sizes = sorted(args.sizes_mb)
    corpora = {}
    for size in sizes:
        start = time.perf_counter()
        corpora[size] = write_corpus(workdir / f"corpus_{size:g}mb.jsonl", size)
        print(f"wrote {corpora[size]} ({size:g} MB) in {time.perf_counter() - start:.0f} s", file=sys.stderr)

    # The tokenizer, trained once (sample pass + SentencePiece) with all workers on the smallest corpus.
    first = prepare(corpora[sizes[0]], workdir / "tokenizer", workers=cores,
                    extra=[f"--data.vocab_size={args.vocab_size}"])
    tokenizer = ["--data.tokenizer_model=" + str(workdir / "tokenizer" / "tokenizer.model")]
    sample_rate = first["text_bytes"] / 2**20 / first["phases"]["tokenizer sample"]

    rows = []
    for size in sizes:
        base = None
        for n in workers:
            print(f"measuring {size:g} MB with {n} worker(s) ...", file=sys.stderr)
            run = prepare(corpora[size], workdir / "out", workers=n, extra=tokenizer)
            rate = run["text_bytes"] / 2**20 / run["phases"]["tokenising"]
            base = base or (rate if n == 1 else None)
            rows.append((size, n, run, rate, base))

    print(f"\n{cpu_name()}, {cores} cores; python {platform.python_version()}; synthetic .jsonl, "
          f"SentencePiece BPE vocabulary {args.vocab_size}, tokenizer trained beforehand\n")
    print("| corpus | workers | tokenising (wall) | MB/s | tokens/s | speedup (efficiency) | CPU time, cores busy "
          "| MB per CPU-second | peak heap, all processes | peak RSS, all processes | largest process (RSS) "
          "| load avg |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, n, run, rate, base in rows:
        seconds = run["phases"]["tokenising"]
        speedup = f"{rate / base:.2f}x ({rate / base / n:.0%})" if base else "n/a"
        print(f"| {size:g} MB | {n} | {seconds:.0f} s ({run['seconds']:.0f} s) | {rate:.1f} | "
              f"{run['tokens'] / seconds / 1e6:.2f}M | {speedup} | {run['cpu_seconds']:.0f} s, "
              f"{run['cpu_seconds'] / run['seconds']:.1f} | {run['text_bytes'] / 2**20 / run['cpu_seconds']:.1f} | "
              f"{run['peak_anon'] / 2**30:.2f} GiB | "
              f"{run['peak_rss'] / 2**30:.2f} GiB | {run['peak_one'] / 2**30:.2f} GiB | {run['load']:.1f} |")

    largest = [row for row in rows if row[0] == sizes[-1] and row[1] == max(workers)][0]
    encode_rate = largest[3]
    hours = (100 * 1024 / encode_rate + 100 * 1024 / sample_rate + first["phases"]["tokenizer training"]) / 3600
    print(f"\nTokenizer trained once ({sizes[0]:g} MB, {cores} workers): sample pass "
          f"{first['phases']['tokenizer sample']:.0f} s ({sample_rate:.0f} MB/s), SentencePiece training "
          f"{first['phases']['tokenizer training']:.0f} s.")
    print(f"Projected for 100 GB with {max(workers)} workers: {hours:.1f} h (tokenising at {encode_rate:.1f} MB/s, "
          f"sample pass at {sample_rate:.0f} MB/s, training {first['phases']['tokenizer training']:.0f} s).")


if __name__ == "__main__":
    sys.exit(main())
