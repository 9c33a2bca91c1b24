"""Live dashboard: a small FastAPI JSON API over the Delta tables plus one static page."""
