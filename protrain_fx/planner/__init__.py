"""Plan stage: the Plan record (plan.py); cost models and the search come in later versions."""
