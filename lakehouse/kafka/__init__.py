"""Kafka for iotlake's clients: the embedded broker's credential (``auth``), librdkafka client
configuration from settings (``config``) and the topics, created before use (``topics``)."""
