"""Downstream evaluation with EleutherAI's lm-evaluation-harness (the optional lm-eval package): finding and
checking tasks, running them on an lm_eval LM, the flat metrics logged next to val_loss, and the training
component behind train.eval_tasks.

lm_eval is imported only inside these functions, so a run without train.eval_tasks never needs it.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..distributed import DistEnv, agree

if TYPE_CHECKING:
    from config import TrainConfig

log = logging.getLogger("train")

LM_EVAL_MISSING = "needs the lm-eval package (EleutherAI's lm-evaluation-harness): pip install lm-eval"
# lm_eval's own defaults (simple_evaluate): the same seeds give the same few-shot examples.
FEWSHOT_SEED = 1234


class DownstreamError(ValueError):
    """A task that cannot be found or loaded, or lm-eval missing; the message names the option."""


def lm_eval_missing() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return True
    return False


def _is_task_file(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) and Path(name).is_file()


@functools.lru_cache(maxsize=4)
def _manager(include_path: tuple[str, ...], with_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include_path) or None, include_defaults=with_defaults)


def task_manager(names: Sequence[str], include_path: Sequence[str] = ()):
    """lm_eval's TaskManager for `names`: the folders of include_path alone when they hold every task named
    (indexing lm_eval's thousands of built-in tasks is slow), else those folders and the built-in
    tasks. Kept per process: the check before the process group and the run share it."""
    local = _manager(tuple(include_path), False) if include_path else None
    if local is not None and all(n in local.task_index or _is_task_file(n) for n in names):
        return local
    return _manager(tuple(include_path), True)


def task_problems(names: Sequence[str], include_path: Sequence[str] = (), *, where: str) -> list[str]:
    """lm-eval importable, every include_path folder there, every task name known; one line each."""
    if not names:
        return []
    if lm_eval_missing():
        return [f"{where} {LM_EVAL_MISSING}"]
    problems = [f"{where}: task folder not found: {p}" for p in include_path if not Path(p).exists()]
    if problems:
        return problems
    manager = task_manager(names, include_path)
    for name in names:
        if name not in manager.task_index and not _is_task_file(name):
            match = difflib.get_close_matches(name, manager.all_tasks, n=1, cutoff=0.6)
            hint = f" (did you mean '{match[0]}'?)" if match else " (a task, group or tag name, or a task .yaml file)"
            problems.append(f"{where}: unknown lm-eval task '{name}'{hint}")
    return problems


def load_tasks(manager, names: Sequence[str], *, num_fewshot: int | None = None) -> dict:
    """lm_eval's task dict for `names`, datasets loaded, few-shot settings as lm_eval's simple_evaluate makes
    them (num_fewshot: instead of each task's own); DownstreamError in one line if a task cannot load."""
    try:
        loaded = manager.load(list(names))
    except Exception as err:  # lm_eval and datasets raise many kinds (no network, a bad YAML): say which and why
        text = str(err).strip().splitlines()
        raise DownstreamError(f"cannot load the lm-eval task(s) {', '.join(names)}: {type(err).__name__}: "
                              f"{text[0] if text else ''}") from None
    for task in loaded["tasks"].values():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return loaded


@contextlib.contextmanager
def seeded_rng() -> Iterator[None]:
    """lm_eval's seeds inside, the caller's random states (Python, NumPy, torch) as they were afterwards:
    an evaluation in training leaves the training's random streams untouched."""
    py_state, np_state = random.getstate(), np.random.get_state()
    # This rank's GPU only: forking every visible device would make a CUDA context on each.
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_initialized() else []):
        random.seed(0)
        np.random.seed(FEWSHOT_SEED)
        torch.manual_seed(FEWSHOT_SEED)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def run_tasks(lm, task_dict: dict, *, limit: int | None = None, bootstrap_iters: int = 0) -> dict:
    """lm_eval's results for the loaded tasks (every rank gets them: see fsdp_utils/evaluation/lm_eval_model.py)."""
    from lm_eval.evaluator import evaluate

    with seeded_rng():
        results = evaluate(lm=lm, task_dict=task_dict, limit=limit or None, bootstrap_iters=bootstrap_iters,
                           log_samples=False)
    assert results is not None, "lm_eval returns results to rank 0 of its world, which every rank is"
    return dict(results)


def flat_metrics(results: dict) -> dict[str, float]:
    """{'eval/<task>/<metric>': value} of every numeric metric (no standard errors); a metric under a filter
    other than lm_eval's default 'none' is named '<metric>_<filter>'."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filter_name = key.partition(",")
            out[f"eval/{task}/{metric if filter_name == 'none' else f'{metric}_{filter_name}'}"] = float(value)
    return out


def quiet_lm_eval() -> None:
    """lm_eval's and datasets' per-task info lines and progress bars stay out of the training log."""
    import datasets

    datasets.disable_progress_bars()
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.WARNING)


class DownstreamEvaluator:
    """train.eval_tasks in training: the tasks (and their datasets) are loaded at construction (before step 1,
    so a task that cannot load stops the run then); `run` evaluates the model as it is (sharded: every rank
    takes part), in eval mode, and puts it back in train mode."""

    def __init__(self, section: TrainConfig, *, tokenizer_kind: str, tokenizer_path: Path, max_length: int,
                 env: DistEnv):
        """section: train.eval_tasks, eval_tasks_path and eval_tasks_limit; the tokenizer and the longest
        sequence (data.tokenizer, the prepared tokenizer file, data.seq_len) are the run's."""
        from .lm_eval_model import open_codec

        quiet_lm_eval()
        self.names, self.limit = list(section.eval_tasks), section.eval_tasks_limit
        self.max_length, self.env = max_length, env
        # Loaded once: lm_eval rebuilds a task's requests at every evaluation.
        self.tasks = load_tasks(task_manager(self.names, section.eval_tasks_path), self.names)
        try:
            self.codec = open_codec(tokenizer_kind, tokenizer_path)
        except (OSError, ValueError) as err:
            raise DownstreamError(f"train.eval_tasks: cannot use the run's tokenizer {tokenizer_path}: {err}") from None

    def run(self, model: nn.Module, *, batch_size: int) -> dict[str, Any]:
        """The flat metrics of every task, and 'downstream_time_s'."""
        from .lm_eval_model import ModelLM

        started = time.perf_counter()
        model.eval()
        try:
            lm = ModelLM(model, self.codec, device=self.env.device, batch_size=batch_size, max_length=self.max_length)
            with contextlib.redirect_stderr(io.StringIO()):  # lm_eval's progress bars, on every rank
                results = run_tasks(lm, self.tasks, limit=self.limit)
        finally:
            model.train()
        return flat_metrics(results) | {"downstream_time_s": time.perf_counter() - started}


def open_downstream(section: TrainConfig, *, tokenizer_kind: str, tokenizer_path: Path, max_length: int,
                    env: DistEnv) -> DownstreamEvaluator | None:
    """train.eval_tasks' evaluator, its tasks loaded now, so that one that cannot load stops the run before step 1
    (on every rank: a rank that could not load them must not leave the others waiting in a collective); None
    without tasks."""
    if not section.eval_tasks:
        return None
    evaluator, error = None, None
    try:
        evaluator = DownstreamEvaluator(section, tokenizer_kind=tokenizer_kind, tokenizer_path=tokenizer_path,
                                        max_length=max_length, env=env)
    except DownstreamError as err:
        error = err
    agree(env, error)
    return evaluator
