"""bronze layer of iotlake."""
