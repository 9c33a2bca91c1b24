"""``python -m ingest.bridge``: one bridge instance, its arguments the CLI's
(``ingest.cli.bridge_main``; ``iotlake bridge --instances K`` starts K of these)."""

import sys

from ingest.cli import bridge_main

sys.exit(bridge_main())
