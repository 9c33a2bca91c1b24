"""The alert engine inside ``iotlake run``: its threads, its inputs and its receivers.

The process that runs silver and gold (roles ``all`` and ``streams``) evaluates the rules: it
sees silver's and gold's batches as they are made (``lakehouse.monitoring.observers``), reads
``device_current`` and the run's status snapshot, and delivers through the outbox. A backfill
or reprocess is another process without an engine, so it never fires an alert.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from gold.alerts import store
from gold.alerts.channels import channels_for
from gold.alerts.engine import AlertEngine
from gold.alerts.outbox import Outbox
from gold.alerts.tables import AlertTables
from lakehouse.monitoring import observers
from lakehouse.settings import Settings

log = logging.getLogger(__name__)


@contextlib.contextmanager
def alerting(spark, settings: Settings, pipeline: Callable[[], dict | None] | None = None
             ) -> Iterator[AlertEngine | None]:
    """Run the engine, its Delta writer and the outbox's delivery until the block ends."""
    if not settings.alerts.enabled or not settings.alerts.rules:
        yield None
        return
    channels = channels_for(settings)
    if not channels:
        log.info("alerts: no receiver configured (alerts.alertmanager_url, webhook_url, "
                 "mqtt_topic): alerts go to the alerts tables only")
    outbox = Outbox(store.db_path(settings), channels, settings.alerts)
    engine = AlertEngine(settings, outbox, pipeline)
    tables = AlertTables(spark, settings, engine)
    stop = threading.Event()
    unsubscribe = [observers.subscribe("silver", engine.observe_readings),
                   observers.subscribe("gold_scores", engine.observe_scores)]
    threads = [threading.Thread(target=engine.run, args=(stop,), name="alerts", daemon=True),
               threading.Thread(target=tables.run, args=(stop,), name="alerts-tables", daemon=True)]
    outbox.start()
    for t in threads:
        t.start()
    log.info("alerts: %d rules, receivers: %s", len(engine.rules), ", ".join(c.name for c in channels) or "none")
    try:
        yield engine
    finally:
        for u in unsubscribe:
            u()
        stop.set()
        for t in threads:
            t.join(30)
        outbox.stop()
        engine.close()
