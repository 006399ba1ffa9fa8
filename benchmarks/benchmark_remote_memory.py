"""Peak memory of preparing a corpus streamed from an S3-compatible server, next to the same corpus read from disk.

    python benchmarks/benchmark_remote_memory.py --size_mb 2048 --skip_local   # the corpus in files of 256 MB
    python benchmarks/benchmark_remote_memory.py --size_mb 160 --file_mb 160 --workers 1

Uploads a synthetic .jsonl corpus (benchmark_data.py's) to moto's S3 server run in this process, then runs
`scripts/prepare_data.py` on `s3://BUCKET/corpus/*.jsonl` and on the local files with one tokenizer, and prints the peak
memory of each run (sampled as benchmark_data.py does). Needs s3fs and moto[server] (the `dev` extra)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.benchmark_data import cpu_name, prepare, write_corpus

BUCKET = "benchmark-corpus"


def start_s3_server():
    """moto's S3 server on a free port of this machine, and the environment that points botocore at it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull}
    return server, env


def measure(size_mb: float, *, file_mb: float, workers: int, workdir: Path, local: bool = True,
            vocab_size: int = 4096, meta_bytes: int = 0) -> dict:
    """{"s3": run, "local": run} (benchmarks/benchmark_data.prepare's figures) for a corpus of size_mb (each
    document with a "meta" field of meta_bytes: benchmark_data.write_corpus); without local, the S3 run alone."""
    import boto3

    files = []
    for index in range(max(1, round(size_mb / file_mb))):
        files.append(write_corpus(workdir / f"part-{index:04d}.jsonl", min(file_mb, size_mb), seed=index,
                                  meta_bytes=meta_bytes))
    write_corpus(workdir / "sample.jsonl", 8, seed=1000, meta_bytes=meta_bytes)
    tokenizer = prepare(workdir / "sample.jsonl", workdir / "tokenizer", workers=1,
                        extra=[f"--data.vocab_size={vocab_size}"])
    assert tokenizer["tokens"] > 0
    extra = [f"--data.tokenizer_model={workdir / 'tokenizer' / 'tokenizer.model'}"]
    server, env = start_s3_server()
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # for boto3 here and for the prepare process
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for path in files:
            client.upload_file(str(path), BUCKET, f"corpus/{path.name}")
        runs = {"s3": prepare(f"s3://{BUCKET}/corpus/*.jsonl", workdir / "from_s3", workers=workers, extra=extra)}
    finally:
        server.stop()
        for name, value in saved.items():
            os.environ.pop(name, None) if value is None else os.environ.update({name: value})
    if local:
        runs["local"] = prepare(workdir / "part-*.jsonl", workdir / "from_disk", workers=workers, extra=extra)
    for run, folder in zip(runs.values(), ("from_s3", "from_disk"), strict=False):
        run["shards"] = json.loads((workdir / folder / "meta.json").read_text())["shards"]  # names and sha256
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_mb", type=float, default=2048)
    parser.add_argument("--file_mb", type=float, default=256, help="the size of each file of the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip_local", action="store_true", help="measure the S3 run only")
    parser.add_argument("--workdir", default=None, help="where the corpus and outputs go (default: a temporary folder)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="benchmark_remote_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        runs = measure(args.size_mb, file_mb=args.file_mb, workers=args.workers, workdir=workdir,
                       local=not args.skip_local)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{cpu_name()}, {len(os.sched_getaffinity(0))} cores; {args.size_mb:g} MB of .jsonl in files of "
          f"{args.file_mb:g} MB; {args.workers} workers\n")
    print("| source | wall | tokenising MB/s | peak heap, all processes | peak RSS, all processes "
          "| largest process (RSS) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for source, run in runs.items():
        rate = run["text_bytes"] / 2**20 / run["phases"]["tokenising"]
        print(f"| {source} | {run['seconds']:.0f} s | {rate:.1f} | {run['peak_anon'] / 2**30:.2f} GiB | "
              f"{run['peak_rss'] / 2**30:.2f} GiB | {run['peak_one'] / 2**30:.2f} GiB |")
    if "local" in runs:
        print(f"\nthe same shards from both: {runs['s3']['shards'] == runs['local']['shards']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
