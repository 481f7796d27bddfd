"""What mccld reports: its counters (stats), the Prometheus exporter (metrics) and the
HTTP status server mcclctl reads."""
