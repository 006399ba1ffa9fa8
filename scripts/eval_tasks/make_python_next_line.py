"""Write python_next_line.jsonl: which line comes next in a Python standard-library module?

    python scripts/eval_tasks/make_python_next_line.py [--num_items 500] [--seed 0]

Each item is four consecutive non-blank lines of a module (the context), the line that follows them and three
other lines of similar length (the distractors), shuffled. The modules are the running interpreter's, so the file
is shipped, not rebuilt; the default corpus is the same standard library, so this measures how well a model learnt
its training data (and times the evaluation), not how it generalises."""
from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

MODULES = ("argparse", "textwrap", "shlex", "json/decoder", "json/encoder", "difflib", "fractions", "string",
           "statistics", "heapq", "bisect", "calendar", "csv", "dataclasses", "functools", "glob", "ipaddress",
           "pprint", "queue", "random", "sched", "tempfile", "threading", "tokenize", "uuid", "zipfile")
CONTEXT_LINES = 4


def items_of(path: Path, rng: random.Random, per_module: int) -> list[dict]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    starts = rng.sample(range(len(lines) - CONTEXT_LINES), min(per_module, len(lines) - CONTEXT_LINES))
    items = []
    for start in starts:
        answer = lines[start + CONTEXT_LINES]
        pool = [line for line in set(lines) if line != answer and abs(len(line) - len(answer)) <= 8]
        if len(pool) < 3:
            continue
        choices = [answer, *rng.sample(sorted(pool), 3)]
        rng.shuffle(choices)
        items.append({"context": "\n".join(lines[start:start + CONTEXT_LINES]) + "\n", "choices": choices,
                      "answer": choices.index(answer), "module": path.stem})
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_items", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    per_module = -(-args.num_items // len(MODULES)) + 2
    items = [item for name in MODULES for item in items_of(stdlib / f"{name}.py", rng, per_module)]
    items = rng.sample(items, min(args.num_items, len(items)))
    out = Path(__file__).with_name("python_next_line.jsonl")
    out.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"wrote {len(items)} items to {out}")


if __name__ == "__main__":
    main()
