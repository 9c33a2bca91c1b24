"""silver layer of iotlake."""
