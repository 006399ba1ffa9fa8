r"""Prepare a corpus once, outside any training job: tokenizer plus sharded token files in data.dataset_dir.

    python scripts/prepare_data.py config/train1B_fsdp.yaml --data.files=[/corpus/*.jsonl.zst] \
        --data.dataset_dir=/data/c1
    torchrun --nproc_per_node=8 train_fsdp.py config/train1B_fsdp.yaml --data.dataset_dir=/data/c1
    python scripts/prepare_data.py config/train1B_fsdp.yaml --data.hf_dataset.path=/data/saved_dataset \
        --data.dataset_dir=/data/c2       # a Hugging Face dataset (docs/data.md)

Takes the same config file and overrides as train_fsdp.py; rerun the same command after an interruption to continue."""
from __future__ import annotations

import logging
import sys


# Imports live in main(): worker processes start by importing this file, and need none of them.
def main(argv: list[str] | None = None) -> int:
    import argparse

    from config import ConfigError, load_config, split_known_args
    from data import DataError, prepare_data
    from fsdp_utils.train.run_data import prepare_settings

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config, e.g. config/train1B_fsdp.yaml")
    args, overrides = split_known_args(parser, sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(args.config, overrides)
        if cfg.data.sources:
            raise ConfigError(["data.sources lists folders already prepared: prepare each one with its own "
                               "data.files and data.dataset_dir"])
    except ConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    settings = prepare_settings(cfg)
    dataset_dir = settings.folder
    try:
        prepare_data(dataset_dir, settings)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a file that could not be read or written, as one line too
        print(f"error: {err.filename or dataset_dir}: {err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: rerun the same command to continue after the finished shards in {dataset_dir}",
              file=sys.stderr)
        return 130
    print(f"train on it with: --data.dataset_dir={dataset_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
