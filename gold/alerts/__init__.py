"""Alerts: rules and their engine over gold (and the pipeline), and delivery to receivers."""
