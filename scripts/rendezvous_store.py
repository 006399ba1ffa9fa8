"""Host the c10d store of an elastic run's rendezvous apart from the training nodes, so that any node may die
(docs/running.md, "Elastic runs"). Run it where it outlives the job, then point every node at it:

    python scripts/rendezvous_store.py --port 29400                  # on storehost
    RDZV_STORE=storehost:29400 scripts/fsdp_multi_node.sh 10.0.0.1 0 2:4 ...   # on every node

It serves until SIGINT or SIGTERM. A port in use or an address that is not this machine's: one `error:` line,
exit status 2.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
from datetime import timedelta

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=socket.gethostname(),
                        help="this machine's address as the nodes reach it (default: its host name)")
    parser.add_argument("--port", required=True, help="the port to listen on")
    return parser.parse_args(argv)


def check_address(host: str, port: str) -> str | None:
    """Why the store cannot serve at host:port, or None. The server listens on every interface; host must be
    one of this machine's, since the store checks itself through it (another machine's store on the same port
    would otherwise answer)."""
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"--port={port} is not a port number from 1 to 65535"
    try:
        with socket.socket(socket.getaddrinfo(host, None)[0][0], socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError as err:
        return f"--host={host} is not an address of this machine ({err.strerror or err}); name one with --host"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_address(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    # Blocked before the store starts its threads, so that only sigwait below receives them.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        store = dist.TCPStore(args.host, int(args.port), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
    except RuntimeError as err:
        print(f"error: cannot serve the rendezvous store at {args.host}:{args.port}: {str(err).splitlines()[0]}",
              file=sys.stderr)
        return 2
    print(f"rendezvous store at {args.host}:{store.port} (listening on every interface; the nodes take "
          f"RDZV_STORE={args.host}:{store.port}): keep it up for the job's life", flush=True)
    sig = signal.sigwait(STOP_SIGNALS)
    print(f"rendezvous store stopped by {signal.Signals(sig).name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
