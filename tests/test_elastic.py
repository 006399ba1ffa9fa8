"""Elastic runs through scripts/fsdp_multi_node.sh with a node range (1:2): two "nodes" on this machine, each a
torchrun agent with 2 gloo processes, meeting in a c10d rendezvous that node rank 0 hosts or a store run apart
hosts. A node that dies, a node that joins, and a world size that cannot hold the global batch."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from config import fitting_world_sizes, load_config, unfit_world
from tests.helpers import ROOT, TINY, kill_tree, losses, read_metrics, run_train
from tests.test_failures import Job, poll, train_cmd
from tests.test_launchers import CONFIG, free_port, script_env, train_args

# Short rendezvous timeouts: a lone agent forms its world 1 s after it came, and a dead node drops out of the
# rendezvous 8 s after its last heartbeat (not less: a loaded machine may delay a live one's).
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=8"
TIMEOUT_S = 150  # bound on every wait: generous for a loaded machine, far from a hang
RESUMED = re.compile(r"world (\d+) -> (\d+) at step (\d+): resumed from checkpoint (\S+)")


class Node:
    """One agent: scripts/fsdp_multi_node.sh 127.0.0.1 RANK 1:2, its output in a file. The run id is the launcher's
    (node rank 0 makes one) unless extra_env gives RDZV_ID."""

    def __init__(self, tmp_path: Path, node_rank: int, port: int, args: list[str], **extra_env: str):
        self.log_path = tmp_path / f"node{node_rank}.log"
        self._log = open(self.log_path, "w")
        env = script_env(NPROC_PER_NODE="2", MASTER_PORT=str(port), CONFIG=str(CONFIG), RDZV_CONF=RDZV_CONF,
                         **extra_env)
        self.proc = subprocess.Popen([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", str(node_rank), "1:2",
                                      *args], cwd=tmp_path, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        """SIGKILL the launcher, its torchrun and the workers (they live in sessions of their own)."""
        kill_tree(self.proc)
        self._log.close()


def wait_until(what: str, condition: Callable[[], bool], nodes: list[Node]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        ended = [n for n in nodes if n.proc.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n\n".join(n.text()[-4000:] for n in nodes)
            pytest.fail(f"{what}: {'a node ended' if ended else 'timed out'}\n{logs}")
        time.sleep(0.05)


def finish(nodes: list[Node]) -> list[int]:
    return [n.proc.wait(timeout=TIMEOUT_S) for n in nodes]


def logged_steps(out: Path) -> list[int]:
    return [row["step"] for row in read_metrics(out) if "loss" in row] if (out / "metrics.jsonl").exists() else []


def saved_steps(out: Path) -> list[int]:
    return [int(p.name[len("fsdp_cpt"):-len(".pth")]) for p in out.glob("fsdp_cpt*.pth")]


def resumed(text: str) -> list[tuple[int, int, int, str]]:
    return [(int(a), int(b), int(step), path) for a, b, step, path in RESUMED.findall(text)]


def stop_after(node: Node, out: Path, step: int, nodes: list[Node]) -> int:
    """Ctrl-C on `node` once `step` is logged (a user's stop: the job saves and ends with 0); the step it stops at."""
    wait_until(f"step {step} logged", lambda: max(logged_steps(out), default=0) >= step, nodes)
    node.proc.send_signal(signal.SIGINT)
    assert finish(nodes) == [0] * len(nodes), "\n\n".join(n.text()[-4000:] for n in nodes)
    text = "".join(n.text() for n in nodes)
    stopped = [int(s) for s in re.findall(r"stopped by a signal at step (\d+) after saving", text)]
    assert len(stopped) == 1, text[-6000:]
    return stopped[0]


# A constant learning rate: a reference that stops at another train.max_steps follows the same schedule.
def job_args(out: Path, corpus: Path, dataset_dir: Path, *extra: str) -> list[str]:
    return train_args(out, corpus, dataset_dir, "--train.max_steps=1000", "--train.lr_schedule=constant",
                      "--checkpoint.auto_resume=true", "--checkpoint.keep_last_n=0", *extra)


@pytest.fixture
def nodes():
    started: list[Node] = []
    yield started
    for node in started:
        node.kill()


@pytest.mark.parametrize("batch,micro,sizes", [(8, 2, [1, 2, 4]), (6, 1, [1, 2, 3, 6]),
                                              (12, "auto", [1, 2, 3, 4, 6, 12])])
def test_the_world_sizes_that_fit(batch, micro, sizes):
    cfg = load_config(CONFIG, [*TINY, f"--train.global_batch_size={batch}", f"--train.micro_batch_size={micro}"])
    assert fitting_world_sizes(cfg.train) == sizes
    assert [w for w in range(1, 13) if not unfit_world(cfg.train, w)] == sizes


@pytest.mark.slow
def test_torchruns_sigterm_to_one_worker_has_every_worker_save_and_ask_for_a_restart(corpus, dataset_dir, tmp_path):
    """torchrun stops its workers with SIGTERM to restart them; another node's workers stop with them after the
    same step without a signal of their own: they too must exit non-zero, or their torchrun ends the job. Here
    rank 0 plays such a worker: only rank 1 gets the signal."""
    out = tmp_path / "out"
    cmd = train_cmd("--train.max_steps=1000", "--checkpoint.interval=0", nproc=2, out_dir=out, corpus=corpus,
                    dataset_dir=dataset_dir)
    job = Job(cmd, tmp_path / "run", extra_env={"FSDP_ELASTIC": "1"})
    try:
        poll(lambda: len(logged_steps(out)) >= 2, job=job, timeout=TIMEOUT_S, what="second metrics row")
        os.kill(job.workers()[1], signal.SIGTERM)
        assert job.wait(timeout=TIMEOUT_S) != 0  # torchrun without --max-restarts reports the failure
    finally:
        job.kill()
    k = logged_steps(out)[-1]
    assert f"rank0] stopped by torchrun at step {k} after saving" in job.stderr, job.stderr[-4000:]
    assert "exitcode: 75" in job.stderr and (out / f"fsdp_cpt{k}.pth").exists()


@pytest.mark.slow
def test_a_node_that_dies_leaves_the_job_at_world_2_resumed_exactly(corpus, dataset_dir, tmp_path, nodes):
    out = tmp_path / "out"
    port = free_port()
    nodes += [Node(tmp_path, 0, port, job_args(out, corpus, dataset_dir, "--checkpoint.interval=5")),
              Node(tmp_path, 1, port, job_args(out, corpus, dataset_dir, "--checkpoint.interval=5"))]
    wait_until("world 4", lambda: "world size 4 on cpu" in nodes[0].text() + nodes[1].text(), nodes)
    first = max(logged_steps(out), default=0)
    wait_until("a checkpoint of world 4", lambda: max(saved_steps(out), default=0) > first, nodes)
    nodes[1].kill()  # node rank 1 does not host the rendezvous store
    wait_until("the resume at world 2", lambda: any(r[:2] == (4, 2) for r in resumed(nodes[0].text())), nodes[:1])
    (_, _, step, path), = [r for r in resumed(nodes[0].text()) if r[:2] == (4, 2)]
    assert path == str(out / f"fsdp_cpt{step}.pth") and step > first
    last = stop_after(nodes[0], out, step + 8, nodes[:1])
    got = losses(out)
    assert sorted(got) == list(range(1, last + 1))

    # The reference: world 4 to the same checkpoint, then resumed at world 2 to the same last step.
    ref = tmp_path / "ref"
    ref_args = ("--train.lr_schedule=constant", "--checkpoint.interval=0", "--checkpoint.keep_last_n=0")
    run_train(*ref_args, f"--train.max_steps={step}", nproc=4, out_dir=ref, corpus=corpus, dataset_dir=dataset_dir,
              timeout=TIMEOUT_S)
    run_train(*ref_args, f"--train.max_steps={last}", "--resume_from=latest", nproc=2, out_dir=ref, corpus=corpus,
              dataset_dir=dataset_dir, timeout=TIMEOUT_S)
    reference = losses(ref)
    after = range(step + 1, last + 1)
    assert [got[k] for k in after] == pytest.approx([reference[k] for k in after], rel=1e-4)


@pytest.mark.slow
def test_a_node_that_joins_continues_at_world_4_without_losing_a_step(corpus, dataset_dir, tmp_path, nodes):
    out = tmp_path / "out"
    args = job_args(out, corpus, dataset_dir, "--checkpoint.interval=0")
    port = free_port()
    nodes.append(Node(tmp_path, 0, port, args))
    wait_until("world 2 trained a few steps", lambda: len(logged_steps(out)) >= 5, nodes)
    nodes.append(Node(tmp_path, 1, port, args))
    wait_until("the resume at world 4", lambda: bool(resumed(nodes[0].text() + nodes[1].text())), nodes)
    text = nodes[0].text() + nodes[1].text()
    stopped = [int(s) for s in re.findall(r"stopped by torchrun at step (\d+) after saving", text)]
    (before, after, step, _), = resumed(text)
    assert (before, after) == (2, 4) and stopped == [step], text[-6000:]  # resumed where it stopped: nothing lost
    last = stop_after(nodes[0], out, step + 5, nodes)
    assert logged_steps(out) == list(range(1, last + 1))  # every step once, in order


@pytest.mark.slow
def test_a_world_size_that_cannot_hold_the_batch_waits_for_the_next(corpus, dataset_dir, tmp_path, nodes):
    out = tmp_path / "out"
    # 6 sequences of 1 per step: worlds 1, 2, 3 and 6 can hold them, world 4 cannot.
    args = job_args(out, corpus, dataset_dir, "--checkpoint.interval=0", "--train.global_batch_size=6",
                    "--train.micro_batch_size=1")
    port = free_port()
    nodes.append(Node(tmp_path, 0, port, args))
    wait_until("world 2 trained a few steps", lambda: len(logged_steps(out)) >= 3, nodes)
    nodes.append(Node(tmp_path, 1, port, args))
    refusal = ("world size 4 cannot hold train.global_batch_size=6 (train.micro_batch_size=1); the world sizes that "
               "can: 1, 2, 3, 6. Waiting for a node to join or leave")
    wait_until("world 4 refused", lambda: refusal in nodes[0].text() + nodes[1].text(), nodes)
    # No restart loop: the agents keep their idle workers (a loop would restart them every few tenths of a second).
    time.sleep(3)
    text = nodes[0].text() + nodes[1].text()
    assert text.count(refusal) == 1 and "Worker group FAILED" not in text, text[-6000:]
    assert "world size 4 on cpu" not in text
    nodes[1].kill()  # the idle workers of node 0 see their peers go, and torchrun restarts them at world 2
    # World 4 never trained: the restart continues where world 2 stopped for it.
    wait_until("the resume at world 2", lambda: bool(resumed(nodes[0].text())), nodes[:1])
    (before, after, step, _), = resumed(nodes[0].text())
    assert (before, after) == (2, 2)
    assert [int(s) for s in re.findall(r"stopped by torchrun at step (\d+) after saving", nodes[0].text())] == [step]
    last = stop_after(nodes[0], out, max(logged_steps(out)) + 3, nodes[:1])
    assert logged_steps(out) == list(range(1, last + 1))
    assert "".join(n.text() for n in nodes).count("cannot hold") == 1


def reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


ROGUE = """import pathlib, sys, time
pathlib.Path(sys.argv[1]).touch()
time.sleep(120)
"""


def refuse_joiners(tmp_path: Path, port: int, args: list[str], nodes: list[Node]) -> None:
    """A node started with another config, or another RDZV_ID, says so in one line and exits 2 before its agent
    joins the rendezvous."""
    run_id = re.search(r"elastic: run id (\S+); this node's config is the job's", nodes[0].text()).group(1)
    assert re.fullmatch("[0-9a-f]{32}", run_id)
    for rank, extra, env, error in [
        (1, ["--train.lr=0.02"], {}, f"error: this node's config differs from the job's (run {run_id} at "
                                     f"127.0.0.1:{port}): train.lr=0.02 here, 0.01 in the job; it does not join"),
        (2, [], {"RDZV_ID": "another-run"}, f"error: RDZV_ID=another-run is not the run id of the job at "
                                            f"127.0.0.1:{port} (node rank 0 runs it as {run_id}): give every node "
                                            "the same RDZV_ID, or none")]:
        joiner = Node(tmp_path, rank, port, [*args, *extra], **env)
        nodes.append(joiner)
        assert joiner.proc.wait(timeout=TIMEOUT_S) == 2, joiner.text()[-4000:]
        assert [line for line in joiner.text().splitlines() if line.startswith("error")] == [error], joiner.text()
        assert "Traceback" not in joiner.text()


def start_rogue_agent(tmp_path: Path, port: int, nodes: list[Node]) -> subprocess.Popen:
    """A torchrun agent that computes the id the launcher once made from the config's file name and the address (a
    checksum): it would join the job's rendezvous and restart it, were the launcher's id not random. Its worker
    runs once the agent forms a world of its own."""
    checksum = subprocess.run(["cksum"], input=f"{CONFIG.name} 127.0.0.1:{port}", capture_output=True, text=True,
                              check=True).stdout.split()[0]
    (tmp_path / "rogue.py").write_text(ROGUE)
    ran = tmp_path / "rogue-ran"
    with open(tmp_path / "rogue.log", "w") as log:
        rogue = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=fsdp-{checksum}",
             f"--rdzv_conf=is_host=false,{RDZV_CONF}", str(tmp_path / "rogue.py"), str(ran)],
            cwd=tmp_path, env=script_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("the rogue agent's worker started", ran.exists, nodes)
    except BaseException:
        kill_tree(rogue)
        raise
    return rogue


# One job serves both checks below: each restarts a torchrun job, and the job must train on through both.
@pytest.mark.slow
def test_a_node_whose_config_or_run_id_differs_and_an_agent_with_a_made_up_run_id_leave_the_job_alone(
        corpus, dataset_dir, tmp_path, nodes):
    """Node rank 0 hosts the store on MASTER_ADDR only, under a random run id that the other nodes read there. A
    node started with another config or another RDZV_ID is refused before its agent joins, and an agent with the
    run id the launcher once made from the config and the address meets no one: the job neither restarts nor
    stops."""
    out = tmp_path / "out"
    port = free_port()
    args = job_args(out, corpus, dataset_dir, "--checkpoint.interval=0")
    nodes.append(Node(tmp_path, 0, port, args))
    wait_until("world 2 trained a few steps", lambda: len(logged_steps(out)) >= 3, nodes)
    # 127.0.0.0/8 is all loopback: a store listening on every interface would answer at 127.0.0.2 too.
    assert reachable("127.0.0.1", port) and not reachable("127.0.0.2", port)
    refuse_joiners(tmp_path, port, args, nodes)
    rogue = start_rogue_agent(tmp_path, port, nodes[:1])
    try:
        steps = len(logged_steps(out))
        wait_until("node 0 trains on", lambda: len(logged_steps(out)) >= steps + 3, nodes[:1])
    finally:
        kill_tree(rogue)
    assert "stopped by torchrun" not in nodes[0].text() and not resumed(nodes[0].text())
    last = stop_after(nodes[0], out, len(logged_steps(out)) + 1, nodes[:1])
    assert logged_steps(out) == list(range(1, last + 1))  # one world throughout, every step once


STORE_SCRIPT = ROOT / "scripts/rendezvous_store.py"


@contextlib.contextmanager
def store_script(tmp_path: Path, host: str):
    """scripts/rendezvous_store.py --host=host on a free port: its port, once it serves."""
    port = free_port()
    log_path = tmp_path / f"store-{host}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(STORE_SCRIPT), f"--host={host}", f"--port={port}"],
                                stdout=log, stderr=subprocess.STDOUT, env=script_env())
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while "keep it up for the job's life" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0, log_path.read_text()


@pytest.fixture
def rendezvous_store(tmp_path):
    """scripts/rendezvous_store.py on a free port of this machine: its address."""
    with store_script(tmp_path, "127.0.0.1") as port:
        yield f"127.0.0.1:{port}"


@pytest.mark.parametrize("host,other", [("127.0.0.1", "127.0.0.2"), ("127.0.0.2", "127.0.0.1")])
def test_the_store_script_listens_on_the_address_of_host_only(host, other, tmp_path):
    # 127.0.0.0/8 is all loopback: a store listening on every interface would answer at both addresses.
    with store_script(tmp_path, host) as port:
        assert reachable(host, port) and not reachable(other, port)


def test_the_store_script_on_every_interface_says_so_and_names_an_address_the_nodes_reach(tmp_path):
    """0.0.0.0 listens on every interface: a warning, and the address given to the nodes is this machine's (its host
    name, or its first address that is not a loopback one), which they can reach, not 0.0.0.0."""
    with store_script(tmp_path, "0.0.0.0") as port:
        log = (tmp_path / "store-0.0.0.0.log").read_text()
        (address,) = re.findall(rf"RDZV_STORE=(\S+):{port} ", log)
        assert address != "0.0.0.0" and reachable(address.strip("[]"), port), log
    assert f"warning: --host=0.0.0.0 listens on every interface of this machine: anyone who reaches port {port}" in log
    assert f"rendezvous store at {address}:{port}, listening on every interface (the nodes take" in log


def test_a_malformed_message_to_the_store_script_is_one_line_in_its_log(tmp_path):
    """A client that validates (TCPStore's query 0 and magic number) and then sends a key of 2**40 bytes: torch's store
    refuses it with a warning followed by the C++ stack of where it was raised, some 15 lines of frames. In the
    store's log: the warning's line alone."""
    with store_script(tmp_path, "127.0.0.1") as port:
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 2**40))
            deadline = time.monotonic() + TIMEOUT_S
            while "Invalid string size" not in (tmp_path / "store-127.0.0.1.log").read_text():
                assert time.monotonic() < deadline, "the store never refused the message"
                time.sleep(0.05)
    lines = (tmp_path / "store-127.0.0.1.log").read_text().splitlines()
    assert len(lines) == 3 and "keep it up for the job's life" in lines[0], lines
    assert lines[2] == "rendezvous store stopped by SIGTERM"
    assert lines[1].endswith("Error processing client message: Invalid string size. size: 1099511627776, max: 8192")


def test_the_store_script_refuses_a_host_name_that_no_other_node_can_reach(monkeypatch, capsys):
    """Without --host the store takes the host name, which some systems map to a loopback address in /etc/hosts:
    listening there only, no node could reach it."""
    from scripts import rendezvous_store

    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    assert rendezvous_store.main([f"--port={free_port()}"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: this machine's host name localhost resolves to (127\.0\.0\.1|::1), a loopback "
                        r"address that no other node can reach: name the address the nodes reach with --host\n", err)


@pytest.mark.slow
def test_with_the_store_run_apart_node_rank_0_may_die(corpus, dataset_dir, tmp_path, nodes, rendezvous_store):
    """Node rank 0 is the node that would host the store; it also started first, so its agent, the oldest
    process, is usually rank 0 of the round too, whose workers hold the process group's store."""
    out = tmp_path / "out"
    port = free_port()
    args = job_args(out, corpus, dataset_dir, "--checkpoint.interval=3")
    nodes += [Node(tmp_path, rank, port, args, RDZV_STORE=rendezvous_store, RDZV_ID=f"test-{port}") for rank in (0, 1)]
    wait_until("world 4", lambda: "world size 4 on cpu" in nodes[0].text() + nodes[1].text(), nodes)
    assert f"rendezvous test-{port} at {rendezvous_store}, a store run apart from the nodes" in nodes[0].text()
    first = max(logged_steps(out), default=0)
    wait_until("a checkpoint of world 4", lambda: max(saved_steps(out), default=0) > first, nodes)
    nodes[0].kill()
    wait_until("the resume at world 2", lambda: any(r[:2] == (4, 2) for r in resumed(nodes[1].text())), nodes[1:])
    (_, _, step, path), = [r for r in resumed(nodes[1].text()) if r[:2] == (4, 2)]
    assert path == str(out / f"fsdp_cpt{step}.pth") and step > first
    last = stop_after(nodes[1], out, step + 3, nodes[1:])
    assert sorted(losses(out)) == list(range(1, last + 1))


def test_the_store_script_names_a_port_it_cannot_serve(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # int() would take '٣٠٠٠٠' (Arabic-Indic digits) for 30000, and fail on '²' (a digit to str.isdigit).
        for bad, culprit in [(["--port=70000"], "--port=70000 is not a port number"),
                             (["--port=²"], "--port=² is not a port number from 1 to 65535"),
                             (["--port=٣٠٠٠٠"], "--port=٣٠٠٠٠ is not a port number from 1 to 65535"),
                             ([f"--port={port}"], f"cannot serve the rendezvous store at 127.0.0.1:{port}"),
                             (["--host=203.0.113.7", "--port=29400"], "--host=203.0.113.7 is not an address of this")]:
            proc = subprocess.run([sys.executable, str(STORE_SCRIPT), "--host=127.0.0.1", *bad], capture_output=True,
                                  text=True, env=script_env(), timeout=60)
            assert proc.returncode == 2 and proc.stdout == "", proc.stderr
            assert proc.stderr.startswith("error: ") and culprit in proc.stderr, proc.stderr
            assert proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize("nnodes,store,culprit", [
    ("2", "storehost:29400", "RDZV_STORE=storehost:29400 is for elastic runs (NNODES as a range MIN:MAX)"),
    ("1:2", "storehost", "RDZV_STORE=storehost is not HOST:PORT"),
    ("1:2", "storehost:70000", "RDZV_STORE=storehost:70000 is not HOST:PORT"),
    # A store run apart may serve several jobs: none of them can publish its run id there.
    ("1:2", "storehost:29400", "RDZV_STORE needs RDZV_ID, the same unguessable run id on every node of this job")])
def test_the_launcher_names_a_store_it_cannot_use(nnodes, store, culprit, tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/fsdp_multi_node.sh"), "127.0.0.1", "0", nnodes], capture_output=True,
                          text=True, cwd=tmp_path, env=script_env(RDZV_STORE=store, NPROC_PER_NODE="2"), timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {culprit}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("setting", ["join_timeout=²", "join_timeout=٣٠", "last_call_timeout=1.5",
                                     "keep_alive_max_attempt=-1"])
def test_a_rendezvous_setting_that_is_not_a_whole_number_is_one_error_line(setting, capsys):
    """RDZV_CONF reaches torchrun's --rdzv_conf, whose numbers torchrun reads with int(): '٣٠' as 30, '²' a
    traceback. Refused before the node looks for the store (no store answers at this endpoint: a join would wait
    join_timeout for it)."""
    from scripts import _torchrun

    start = time.monotonic()
    assert _torchrun.main(["--store=join", "--", "--nnodes=1:2", "--rdzv_backend=c10d",
                           f"--rdzv_endpoint=127.0.0.1:{free_port()}", f"--rdzv_conf=is_host=false,{setting}",
                           "train_fsdp.py"]) == 2
    assert capsys.readouterr().err == f"error: --rdzv_conf (RDZV_CONF): {setting} is not a whole number of at least 0\n"
    assert time.monotonic() - start < 5
