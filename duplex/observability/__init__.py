"""What the server tells its operators: Prometheus metrics and JSON logs with session context."""
