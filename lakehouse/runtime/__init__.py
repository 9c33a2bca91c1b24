"""JVM and process tuning, each behind a setting: where the JVM dependencies are, the JVMs'
options (``jars``), their class-data archives, the local-filesystem shim
compiled at first use (``jvm``, ``spark.local_fs_shim``), py4j's remembered names
(``jvm_names``), native memory handed back (``native_memory``) and the code shipped to
executors (``deploy``). Below ``lakehouse.spark``, which applies them: nothing here imports it.
"""
