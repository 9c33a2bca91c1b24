"""The foundation every stage uses. At the top: settings, the telemetry model, storage, table
schemas, the device registry, the Spark session and stream helpers; in subpackages: Delta reads
and writes (``delta``), Kafka (``kafka``), MQTT (``mqtt``), metrics and status (``monitoring``)
and JVM and process tuning (``runtime``, below the Spark session). Imports no stage and nothing
above (tests/test_layout.py)."""
