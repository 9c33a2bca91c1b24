"""Delta tables: reads without a JVM (``read``, delta-rs), writes exactly once per micro-batch
(``tables``, delta-spark), commits through Delta's transaction API (``txn``) of Parquet files the
driver writes (``parquet_files``), and a batch's writes run at once (``concurrent_writes``)."""
