"""ingest layer of iotlake."""
