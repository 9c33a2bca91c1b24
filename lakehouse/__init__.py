"""The foundation every stage uses: settings, the Spark session and its jars, storage, table
schemas, stream helpers, Delta readers and writers, Kafka topics and client config, metrics.
Imports no stage and nothing above (tests/test_layout.py)."""
