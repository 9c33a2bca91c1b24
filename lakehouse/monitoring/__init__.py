"""What a running pipeline tells: streaming metrics to Delta and Prometheus (``metrics``), a
batch's rows to in-process subscribers (``observers``) and ``iotlake run``'s status file
(``status_file``)."""
