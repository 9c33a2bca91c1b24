"""``iotlake dashboard``: serve the live dashboard (FastAPI + uvicorn) on localhost by default."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from lakehouse.settings import Settings

TOKEN_ENV = "IOTLAKE_DASHBOARD_TOKEN"
log = logging.getLogger(__name__)

# Taken out of the environment when the parser is built, i.e. before settings are loaded: the
# settings loader would reject an unknown IOTLAKE_ key, and child processes need not inherit it.
_env_token: str | None = None


def _fail(message: str) -> int:
    print(f"iotlake dashboard: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace, settings: Settings) -> int:
    if args.token is not None:  # an argument is in every user's `ps` and in shell history
        return _fail(f"--token would show in `ps`; put the token in {TOKEN_ENV} or in a file "
                     "read with --token-file FILE")
    token = _env_token
    if args.token_file:
        path = Path(args.token_file)
        try:
            token = path.read_text().strip()
        except OSError as e:
            return _fail(f"cannot read --token-file {path}: {e.strerror}")
        if not token:
            return _fail(f"--token-file {path} is empty")
        if path.stat().st_mode & 0o077:
            log.warning("dashboard: %s can be read by other users (chmod 600 it)", path)

    import uvicorn

    from dashboard.app import allowed_hosts, create_app

    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning("dashboard bound to %s without a token: anyone who can reach it can read "
                    "the fleet (set %s or --token-file)", args.host, TOKEN_ENV)
    log.info("dashboard on http://%s:%d/ (%s)", args.host, args.port,
             "token required" if token else
             "answers to " + ", ".join(sorted(allowed_hosts(settings, args.host))))
    uvicorn.run(create_app(settings, token=token, bind=args.host), host=args.host,
                port=args.port, log_level="warning", access_log=False)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    global _env_token
    _env_token = os.environ.pop(TOKEN_ENV, None) or _env_token
    p = subparsers.add_parser("dashboard", help="serve the live web dashboard",
                              description="Serve the live dashboard over the Delta tables.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--token-file", metavar="FILE",
                   help=f"require 'Authorization: Bearer TOKEN' on /api, TOKEN read from FILE (or "
                        f"set {TOKEN_ENV}); open the page as http://HOST:PORT/#token=TOKEN")
    p.add_argument("--token", help=argparse.SUPPRESS)  # refused with a message saying why
    p.set_defaults(func=_run)
