"""CLI: python -m publisher.testing.hubserver --data DIR --port N [--token NAME=TOKEN ...] [--org ORG=U1,U2 ...]
[--gated REPO[=U1,U2] ...] [--scope TOKEN=ROLE|JSON ...] [--multipart-threshold BYTES] [--verbose]

Runs the loopback Hub in the foreground and prints its base URL on stdout once it is bound (port 0
picks a free one), so a parent process can read one line and use it as HF_ENDPOINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from types import FrameType

from publisher.testing.hubserver.server import HubServer


def _pairs(values: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for value in values:
        key, sep, rest = value.partition("=")
        if not key or (flag != "--gated" and not (sep and rest)):
            raise SystemExit(f"{flag} expects KEY=VALUE, got {value!r}")
        out.append((key, rest))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m publisher.testing.hubserver", description=__doc__.split("\n\n")[1])
    parser.add_argument("--data", required=True, help="persistent data folder (created if missing)")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0: pick a free one)")
    parser.add_argument("--token", action="append", default=[], metavar="NAME=TOKEN",
                        help="accept TOKEN as user NAME (repeatable)")
    parser.add_argument("--org", action="append", default=[], metavar="ORG=USER1,USER2",
                        help="organization and its members (repeatable)")
    parser.add_argument("--gated", action="append", default=[], metavar="REPO[=USER1,USER2]",
                        help="gate a model repo (or datasets/ns/name), granting the listed users")
    parser.add_argument("--verbose", action="store_true", help="log every request on stderr")
    parser.add_argument("--discard-lfs", action="store_true",
                        help="benchmarks: check every LFS upload's size and sha256, record it, drop its bytes")
    parser.add_argument("--scope", action="append", default=[], metavar="TOKEN=ROLE|JSON",
                        help="a token's role: read, or a fine-grained token's JSON permissions (repeatable)")
    parser.add_argument("--multipart-threshold", type=int, default=None, metavar="BYTES",
                        help="LFS objects above this size are uploaded in parts (default: never)")
    parser.add_argument("--bridge-port", type=int, default=0, help="TCP port of the storage bridge (0: pick a free one)")
    parser.add_argument("--bridge-url", default=None, metavar="URL",
                        help="the bridge's URL as the Hub hands it out in redirects (default: its own; a proxy in front "
                             "of it, as the benchmarks' bandwidth-limited link)")
    args = parser.parse_args(argv)

    tokens = {token: name for name, token in _pairs(args.token, "--token")}
    orgs = {org: [u for u in users.split(",") if u] for org, users in _pairs(args.org, "--org")}
    gated = {repo: [u for u in users.split(",") if u] for repo, users in _pairs(args.gated, "--gated")}
    scopes = {token: (value if value in ("read", "write") else json.loads(value))
              for token, value in _pairs(args.scope, "--scope")}
    server = HubServer(args.data, tokens=tokens, orgs=orgs, port=args.port, gated=gated, verbose=args.verbose,
                       discard_lfs=args.discard_lfs, scopes=scopes, multipart_threshold=args.multipart_threshold,
                       bridge_port=args.bridge_port, bridge_public_url=args.bridge_url)

    def _terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds serve_forever so sockets are closed cleanly

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)  # also when started from a shell that ignores SIGINT (`cmd &`)
    print(server.bind(), flush=True)  # the one line spawn_server waits for; nothing else goes to stdout
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
