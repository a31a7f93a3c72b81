"""Pass stage: graph rewrites that carry out the plan, run in the order of pipeline.py."""
