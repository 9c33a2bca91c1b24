"""Shared runtime of iotlake: settings, Spark session, connectors, embedded services, CLI."""
