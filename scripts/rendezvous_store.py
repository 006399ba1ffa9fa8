"""Host the c10d store of an elastic run's rendezvous apart from the training nodes, so that any node may die
(docs/running.md, "Elastic runs"). Run it where it outlives the job, then point every node at it:

    python scripts/rendezvous_store.py --host storehost --port 29400       # on storehost
    export RDZV_STORE=storehost:29400 RDZV_ID=$(openssl rand -hex 16)    # one id per job, the same on every node
    scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4 ...                        # on every node

It listens on the address of --host only and serves until SIGINT or SIGTERM; it has no authentication, so it must
sit on a network only the job's machines reach. A port in use or an address not this machine's: one `error:` line."""
from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
from datetime import timedelta

from config.numbers import integer_in

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class StoreAddressError(Exception):
    """The store cannot serve at the address given: the message is one line naming it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=None,
                        help="the address of this machine that the nodes reach, the only one the store listens on "
                             "(default: the host name, unless it names a loopback address; 0.0.0.0: every interface)")
    parser.add_argument("--port", required=True, help="the port to listen on")
    return parser.parse_args(argv)


def _listening_socket(host: str, port: int, name: str) -> socket.socket:
    """A TCP socket listening on host's address only; `name` is what the user called the address."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as err:
        raise StoreAddressError(f"{name}={host} is not an address of this machine (unknown host: "
                                f"{err.strerror if isinstance(err, OSError) else err}); name one with {name}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRNOTAVAIL:
            raise StoreAddressError(f"{name}={host} is not an address of this machine ({err.strerror}); name one "
                                    f"with {name}") from None
        raise StoreAddressError(f"cannot serve the rendezvous store at {host}:{port}: {err.strerror or err}") from None
    return sock


def serve_store(host: str, port: int, *, name: str = "--host", timeout_s: float = 30):
    """The c10d store (a master TCPStore), listening on the address `host` resolves to and no other: given no
    socket of its own, a TCPStore listens on every interface of the machine. StoreAddressError if it cannot."""
    import torch.distributed as dist

    sock = _listening_socket(host, port, name)
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                             timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise StoreAddressError(f"cannot serve the rendezvous store at {host}:{port}: "
                                f"{str(err).splitlines()[0]}") from None


def default_host() -> str:
    """This machine's host name, unless it resolves to a loopback address, which no other node can reach."""
    host = socket.gethostname()
    try:
        address = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])  # an IPv4 or IPv6 address
    except socket.gaierror:
        return host  # the bind names it
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        raise StoreAddressError(f"this machine's host name {host} resolves to {address}, a loopback address that "
                                "no other node can reach: name the address the nodes reach with --host")
    return host


def advertised_host(host: str) -> str:
    """The address the nodes take for a store listening on `host`: `host` itself, or for an unspecified address
    (0.0.0.0, ::, which listen on every interface) this machine's host name, or else its first address that is not
    a loopback one (the source address of its default route)."""
    try:
        if not ipaddress.ip_address(host.strip("[]")).is_unspecified:
            return host
    except ValueError:  # a host name
        return host
    try:
        return default_host()
    except StoreAddressError:  # the host name is a loopback address here
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:  # a UDP connect sends nothing: it only picks the route, and with it this machine's address
            probe.connect(("2001:db8::1" if family == socket.AF_INET6 else "192.0.2.1", 9))
        except OSError:
            return socket.gethostname()
        address = str(probe.getsockname()[0])
    return f"[{address}]" if ":" in address else address


# What the C++ store writes after the line of a client's malformed message: where the exception was raised and
# its stack, a dozen lines of frames that say nothing to the user of the store.
_CPP_STACK = re.compile(rb"(Exception raised from .*|frame #\d+: .*|)\n")


class OneLineLogs:
    """This process's stderr (file descriptor 2, where the C++ store logs) routed through a thread that keeps the
    first line of each record and drops the C++ stack after it, until stop()."""

    def __init__(self) -> None:
        read_end, write_end = os.pipe()
        self.real_stderr = os.dup(2)
        os.dup2(write_end, 2)
        os.close(write_end)
        self.thread = threading.Thread(target=self._copy, args=(read_end,), name="one-line-logs", daemon=True)
        self.thread.start()

    def _copy(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                if not _CPP_STACK.fullmatch(line):
                    os.write(self.real_stderr, line)

    def stop(self) -> None:
        """stderr back to where it was; the copy ends once it has passed on what the pipe still holds."""
        sys.stderr.flush()
        os.dup2(self.real_stderr, 2)  # closes the pipe's last write end
        self.thread.join(timeout=5)
        os.close(self.real_stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if (port := integer_in(args.port, 1, 65535)) is None:
            raise StoreAddressError(f"--port={args.port} is not a port number from 1 to 65535")
        host = args.host or default_host()
        # Blocked before the store starts its threads, so that only sigwait below receives them.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        store = serve_store(host, port)
    except StoreAddressError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reach = advertised_host(host)
    if reach != host:
        print(f"warning: --host={host} listens on every interface of this machine: anyone who reaches port "
              f"{store.port} on any of them can read and write the rendezvous; name one address with --host",
              file=sys.stderr, flush=True)
    where = "on every interface" if reach != host else "on that address only"
    print(f"rendezvous store at {reach}:{store.port}, listening {where} (the nodes take "
          f"RDZV_STORE={reach}:{store.port} and one RDZV_ID per job): keep it up for the job's life", flush=True)
    logs = OneLineLogs()
    sig = signal.sigwait(STOP_SIGNALS)
    logs.stop()
    print(f"rendezvous store stopped by {signal.Signals(sig).name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
