"""Record the embedded Kafka broker's class-data-sharing archive (``make`` runs this after the jars).

One broker starts on a free port and a temporary data root with ``-XX:ArchiveClassesAtExit``
and stops once it answers: the JVM writes the classes it loaded to the archive as it exits.
Later brokers map them instead of reading, parsing and verifying them from the jars
(``orchestration.services.kafka_service``). The archive belongs to this JDK and these jars: the
Makefile rebuilds it when the jars change, and a broker that cannot use it starts without it.

    .venv/bin/python infra/jvm/kafka_archive.py .jars/cds/kafka-broker.jsa
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from lakehouse.settings import load_settings
from orchestration.services import ServiceError, free_port, kafka_service


def build(target: Path) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="iotlake-kafka-cds-") as tmp:
        dump = Path(tmp) / "kafka-broker.jsa"
        settings = load_settings(environ={}, data_root=str(Path(tmp) / "lake"),
                                 kafka={"embedded_port": free_port(pair=True)})
        svc = kafka_service(settings, record_archive=dump)
        try:
            svc.start(timeout=120)
        except ServiceError as e:
            print(f"warning: {e}", file=sys.stderr)
        finally:
            svc.stop()
        if not dump.is_file():  # not fatal: the broker works without it, only starts slower
            print("Kafka's class archive not built; the broker starts without it", file=sys.stderr)
            return 0
        os.replace(dump, target)
    print(f"Kafka's class archive: {target} ({target.stat().st_size // 2**20} MB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: kafka_archive.py TARGET.jsa")
    raise SystemExit(build(Path(sys.argv[1])))
