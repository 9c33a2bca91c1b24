"""gold layer of iotlake."""
