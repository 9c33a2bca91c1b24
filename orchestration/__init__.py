"""What drives the stages: the ``iotlake`` CLI, ``run`` (pipeline, embedded brokers, roles),
backfill, reprocessing, maintenance, query and SQL. Imports every layer below it; nothing
below imports it (tests/test_layout.py)."""
