from __future__ import annotations

import gc
import os
import signal
from pathlib import Path

import pytest

from tests.helpers import ROOT, write_corpus

# The processes the tests start (scripts, torchrun jobs, tests/with_faults.py) import this checkout's packages and
# tests/, whichever copy of the project the environment has installed, or none.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


def pytest_configure(config):
    # Started in the background of a non-interactive shell (`pytest ... &` in a script), the suite inherits SIGINT
    # ignored, and every job it started would too (an ignored signal stays ignored across exec): the tests that
    # stop a run with Ctrl-C would see it ignored. A handler of our own is reset to the default in those jobs.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
    config.addinivalue_line("markers", "gpu_exclusive: a GPU test that must have its GPUs to itself (it measures "
                                       "memory, or needs more than 2 GPUs); tests/tools/run_gpu_tests.py runs these "
                                       "first, alone")
    config.addinivalue_line("markers", "slow: launches processes (training jobs, torchrun, several ranks); "
                                       "`python -m pytest -m 'not slow'` is the quick loop")


def pytest_sessionfinish(session, exitstatus):
    from tests import launcher

    launcher.shutdown()


def pytest_collection_finish(session):
    # What collection imported (torch, the project, the test modules) lives as long as the session: left out of
    # the garbage collector's passes, each full collection (destroy_distributed runs one after every in-process
    # world) traverses only what the tests made since.
    gc.freeze()
    # The slow tier's Hugging Face jobs would import transformers in every rank: the fork server that their
    # ranks come from (tests/launcher.py) imports it once. The quick tier does not pay for that import. Not
    # on GPU hosts: importing transformers' models there starts CUDA, and a forked rank cannot use it then.
    import torch

    if any(item.get_closest_marker("slow") for item in session.items) and not torch.cuda.is_available():
        from tests import launcher

        launcher.preload_hugging_face()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def world_of_one():
    """A process group of one CPU rank in this pytest process (tests/helpers.py world_of_one)."""
    from tests import helpers

    with helpers.world_of_one() as env:
        yield env


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory) -> Path:
    """One prepared-data cache for the whole session: every run after the first reuses it."""
    return tmp_path_factory.mktemp("dataset")
