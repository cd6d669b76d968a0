"""Demo and example tasks: dataset builders and their rewards (not core code)."""
