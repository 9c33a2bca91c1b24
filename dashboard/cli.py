"""``iotlake dashboard``: serve the live dashboard (FastAPI + uvicorn) on localhost by default."""

from __future__ import annotations

import argparse
import logging
import os

from lakehouse.settings import Settings

TOKEN_ENV = "IOTLAKE_DASHBOARD_TOKEN"
log = logging.getLogger(__name__)

# Taken out of the environment when the parser is built, i.e. before settings are loaded: the
# settings loader would reject an unknown IOTLAKE_ key, and child processes need not inherit it.
_env_token: str | None = None


def _run(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from dashboard.app import create_app

    token = args.token or _env_token
    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        log.warning("dashboard bound to %s without a token: anyone who can reach it can read "
                    "the fleet (set --token or %s)", args.host, TOKEN_ENV)
    log.info("dashboard on http://%s:%d/ (token %s)", args.host, args.port,
             "required" if token else "not required")
    uvicorn.run(create_app(settings, token=token), host=args.host, port=args.port,
                log_level="warning", access_log=False)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    global _env_token
    _env_token = os.environ.pop(TOKEN_ENV, None) or _env_token
    p = subparsers.add_parser("dashboard", help="serve the live web dashboard",
                              description="Serve the live dashboard over the Delta tables.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8050)
    p.add_argument("--token", help=f"require 'Authorization: Bearer TOKEN' on /api (or set "
                                   f"{TOKEN_ENV}); open the page as http://HOST:PORT/#token=TOKEN")
    p.set_defaults(func=_run)
